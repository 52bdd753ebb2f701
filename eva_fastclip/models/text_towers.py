"""Text towers from local files: OpenCLIP / OpenAI CLIP weights, Hugging Face encoders, and locking (LiT).

Names are compared relative to the text tower: open_clip's ``CLIP`` keeps its text modules at the top level
(``token_embedding``, ``transformer.*``, ``ln_final``, ``text_projection``: OpenAI's own names), while
``CustomTextCLIP`` keeps them under ``text.``. Either kind of checkpoint loads into either kind of model.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import open_clip
import torch
from torch import nn

from eva_fastclip.models.weights_file import read_weights

logger = logging.getLogger(__name__)

# Keys of a flat CLIP state dict that belong to no text tower (OpenAI's file also stores three ints).
_NON_TEXT_KEYS = frozenset({"logit_scale", "logit_bias", "input_resolution", "context_length", "vocab_size"})
# Buffers that some checkpoints carry and open_clip / transformers rebuild themselves.
_REBUILT_BUFFERS = ("attn_mask", "position_ids")
_SHOWN = 6  # keys quoted per problem in error messages


@dataclass
class TextLoadReport:
    """What ``load_text_checkpoint`` did; names are relative to the text tower."""

    path: str
    source_format: str
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Tensors of the model left at their initialisation on request (``skip``)."""

    def summary(self) -> str:
        return (
            f"text tower from {self.path} ({self.source_format}): {len(self.loaded)} tensors loaded, "
            f"{len(self.missing)} missing, {len(self.unexpected)} unexpected, {len(self.ignored)} ignored"
            + (f", {len(self.skipped)} skipped ({_quote(self.skipped)})" if self.skipped else "")
        )


# ----------------------------------------------------------------------------------------- name mapping


def _is_custom_text(model: nn.Module) -> bool:
    return isinstance(getattr(model, "text", None), nn.Module)


def text_tower_prefix(model: nn.Module) -> str:
    """Prefix of the text tower's names in ``model.state_dict()`` ("" for open_clip's CLIP)."""
    return "text." if _is_custom_text(model) else ""


def is_text_key(model: nn.Module, name: str) -> bool:
    """True when ``name`` (a parameter or state-dict key of ``model``) belongs to the text tower."""
    if _is_custom_text(model):
        return name.startswith("text.")
    return not name.startswith("visual.") and name not in _NON_TEXT_KEYS


def text_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The text tower's parameters, by their names in ``model``."""
    return {n: p for n, p in model.named_parameters() if is_text_key(model, n)}


def _text_state_dict_of_checkpoint(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The text tower of a CLIP state dict (OpenAI, CLIP or CustomTextCLIP), named relative to the tower."""
    if any(k.startswith("text.") for k in state_dict):
        return {k[len("text.") :]: v for k, v in state_dict.items() if k.startswith("text.")}
    return {k: v for k, v in state_dict.items() if not k.startswith("visual.") and k not in _NON_TEXT_KEYS}


def _match_projection(source: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> None:
    """open_clip's text_projection is a [width, embed] Parameter or (proj_type=linear) an nn.Linear."""
    if "text_projection" in source and "text_projection.weight" in target and "text_projection" not in target:
        source["text_projection.weight"] = source.pop("text_projection").t()
    elif (
        "text_projection.weight" in source
        and "text_projection.bias" not in source
        and "text_projection" in target
        and "text_projection.weight" not in target
    ):
        source["text_projection"] = source.pop("text_projection.weight").t()


def _is_rebuilt(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in _REBUILT_BUFFERS


def _quote(names: list[str]) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


# ---------------------------------------------------------------------------------------------- loading


def load_text_checkpoint(
    model: nn.Module, path: str | Path, *, strict: bool = True, skip: list[str] | tuple[str, ...] = ()
) -> TextLoadReport:
    """Load only the text tower of ``model`` from an open_clip checkpoint or OpenAI's CLIP file.

    ``skip`` names tower tensors (or modules: ``text_projection`` covers ``text_projection.weight``) that
    are not loaded and keep their initialisation (``model.text_checkpoint_skip``); a name that matches
    nothing of the tower is an error.

    Every tensor under the tower's ``transformer`` must load with the model's shape, or ValueError names the
    file and the problem (never a silent partial load). With ``strict`` any other missing or unexpected text
    tensor (token embedding, final norm, projection) is an error too; otherwise it is reported and logged.
    Tensors are cast to the model's dtype (OpenAI's weights are fp16). The vision tower is not touched.
    """
    path = Path(path)
    weights = read_weights(path)
    source = _text_state_dict_of_checkpoint(weights.tensors)
    prefix = text_tower_prefix(model)
    target = {k[len(prefix) :]: v for k, v in model.state_dict().items() if is_text_key(model, k)}
    _match_projection(source, target)

    report = TextLoadReport(str(path), weights.describe())
    _skip_tensors(report, source, target, skip)
    report.ignored = sorted(k for k in source if k not in target and _is_rebuilt(k))
    report.unexpected = sorted(k for k in source if k not in target and not _is_rebuilt(k))
    report.missing = sorted(k for k in target if k not in source)
    report.loaded = sorted(k for k in source if k in target)
    _check_fit(report, path, weights.tensors, source, target, strict=strict)
    if weights.container == "TorchScript archive" and not _uses_quick_gelu(model):
        logger.warning(
            "%s is OpenAI's CLIP file, trained with QuickGELU, but this model uses GELU: its text "
            "features start near, not at, OpenAI's and training adapts them (as EVA-CLIP's GELU towers do)",
            path,
        )

    tensors = {prefix + k: source[k].to(dtype=target[k].dtype) for k in report.loaded}
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys  # every name was taken from the model
    if report.missing or report.unexpected:
        logger.warning(
            "text tower from %s: missing %s; unexpected %s",
            path,
            _quote(report.missing) or "none",
            _quote(report.unexpected) or "none",
        )
    logger.info(report.summary())
    return report


def _skip_tensors(
    report: TextLoadReport,
    source: dict[str, torch.Tensor],
    target: dict[str, torch.Tensor],
    skip: list[str] | tuple[str, ...],
) -> None:
    """Take the tensors ``skip`` names (or the modules' tensors) out of ``source`` and ``target``: they
    keep the model's initialisation. A name that matches nothing of the tower is an error."""
    for name in skip:
        matched = [k for k in target if k == name or k.startswith(name + ".")]
        if not matched:
            raise ValueError(
                f"model.text_checkpoint_skip names {name!r}, which is no tensor of this model's text tower "
                f"(it has e.g. {_quote(sorted(k for k in target if not k.startswith('transformer.')))})"
            )
        for key in matched:
            target.pop(key)
            source.pop(key, None)
            report.skipped.append(key)


def _check_fit(
    report: TextLoadReport,
    path: Path,
    checkpoint: dict[str, torch.Tensor],
    source: dict[str, torch.Tensor],
    target: dict[str, torch.Tensor],
    *,
    strict: bool,
) -> None:
    """Raise ValueError, naming ``path`` and the problem, unless the file's text tower fits the model: its
    transformer wholly, with the model's shapes; with ``strict`` every other text tensor too."""
    blocks = [k for k in target if k.startswith("transformer.")]
    if not any(k.startswith("transformer.") for k in report.loaded):
        found = _quote(sorted(checkpoint)) or "no tensors"
        raise ValueError(
            f"{path}: no text-tower transformer weights for this model in it (model expects e.g. "
            f"{_quote(blocks)}; the file holds {found}); is it a CLIP checkpoint of this architecture?"
        )
    mismatched = [
        f"{k}: file {tuple(source[k].shape)} vs model {tuple(target[k].shape)}"
        for k in report.loaded
        if source[k].shape != target[k].shape
    ]
    if mismatched:
        raise ValueError(
            f"{path}: its text tower does not fit this model (other width, context length or vocabulary?): "
            f"{len(mismatched)} shape mismatches: {'; '.join(mismatched[:_SHOWN])}"
        )
    missing_blocks = [k for k in report.missing if k.startswith("transformer.")]
    extra_blocks = [k for k in report.unexpected if k.startswith("transformer.")]
    if missing_blocks or extra_blocks:
        raise ValueError(
            f"{path}: its text transformer does not match this model's (other depth?): "
            f"missing {_quote(missing_blocks) or 'none'}; unexpected {_quote(extra_blocks) or 'none'}"
        )
    if strict and (report.missing or report.unexpected):
        raise ValueError(
            f"{path}: text tower keys differ from this model's: missing {_quote(report.missing) or 'none'}; "
            f"unexpected {_quote(report.unexpected) or 'none'}"
        )


def _uses_quick_gelu(model: nn.Module) -> bool:
    return any(isinstance(m, open_clip.transformer.QuickGELU) for m in model.modules())


# ------------------------------------------------------------------------------------ Hugging Face towers


def hf_text_model_kwargs(arch: str, folder: str | Path, *, load_weights: bool = True) -> dict[str, Any]:
    """Keyword arguments for ``open_clip.create_model(arch, ...)`` that swap its text tower for the Hugging
    Face encoder in the local ``folder`` (open_clip's HFTextEncoder, always a CustomTextCLIP).

    open_clip applies ``**model_kwargs`` over the architecture's config, so a whole ``text_cfg`` replaces
    the built-in one; it keeps the architecture's context length. An architecture that already names a
    Hugging Face tower keeps its pooler and projection; otherwise mean pooling (sentence-transformers) and
    a linear projection to embed_dim. ``load_weights=False`` builds the encoder from its config alone (when
    a full CLIP checkpoint is loaded afterwards).
    """
    folder = Path(folder).resolve()
    base = open_clip.get_model_config(arch)
    if base is None:
        raise ValueError(f"{arch!r} is not an open_clip architecture")
    text_cfg = copy.deepcopy(base["text_cfg"])
    if "hf_model_name" not in text_cfg:  # pool like sentence-transformers, project like CLIP
        text_cfg.update(hf_pooler_type="mean_pooler", hf_proj_type="linear")
    text_cfg.update(
        hf_model_name=str(folder),  # a path: transformers reads it locally and never asks the hub
        hf_tokenizer_name=str(folder),
        hf_model_pretrained=load_weights,
    )
    context_length = text_cfg.setdefault("context_length", open_clip.tokenizer.DEFAULT_CONTEXT_LENGTH)
    max_positions = json.loads((folder / "config.json").read_text()).get("max_position_embeddings")
    if max_positions is not None and context_length > max_positions:
        raise ValueError(
            f"{arch} tokenizes to {context_length} tokens but the text model in {folder} has only "
            f"{max_positions} positions: choose an architecture with a shorter context_length"
        )
    return {"text_cfg": text_cfg, "force_custom_text": True}


def hf_tokenizer(folder: str | Path, context_length: int) -> open_clip.tokenizer.HFTokenizer:
    """open_clip's HFTokenizer over the tokenizer files in the local ``folder``, padding/truncating to
    ``context_length`` (the pad id is what HFTextEncoder masks out)."""
    return open_clip.tokenizer.HFTokenizer(str(Path(folder).resolve()), context_length=context_length)


def set_text_grad_checkpointing(model: nn.Module, enable: bool) -> None:
    """open_clip's HFTextEncoder.set_grad_checkpointing turns checkpointing on even when asked for off."""
    text = getattr(model, "text", None)
    if isinstance(text, open_clip.hf_model.HFTextEncoder) and not enable:
        text.transformer.gradient_checkpointing_disable()


# -------------------------------------------------------------------------------------------- locking


def lock_text_tower(model: nn.Module, *, new_hf_head: bool = True) -> int:
    """Freeze the pretrained text tower (LiT-style); returns the number of parameter tensors frozen.

    Every text parameter is frozen (what open_clip's own ``lock_text_tower`` does, for every kind of tower),
    except the projection of a Hugging Face encoder while ``new_hf_head``: that head is new (the folder holds
    no CLIP projection), and a random head that never trains would fix the text embedding at random.
    Frozen parameters drop out of the optimizer groups.
    """
    is_hf = isinstance(getattr(model, "text", None), open_clip.hf_model.HFTextEncoder)
    new_head = "text.proj." if is_hf and new_hf_head else None
    frozen = 0
    for name, param in text_parameters(model).items():
        trains = new_head is not None and name.startswith(new_head)
        param.requires_grad_(trains)
        frozen += not trains
    logger.info("text tower locked: %d parameter tensors frozen", frozen)
    return frozen
