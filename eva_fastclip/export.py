"""Export a training checkpoint for open_clip, in one of two forms chosen by the output path:

``model.pt``  an fp32 state dict: ``open_clip.create_model(arch, pretrained="model.pt")`` loads it where the
              architecture's name is known (the shipped tiny ones only after importing eva_fastclip, a
              Hugging Face text tower only with our keyword arguments, SigLIP's ``logit_bias`` only with
              ``init_logit_bias=``);
``model/``    open_clip's own folder (any path without a ``.pt``/``.pth`` suffix): ``open_clip_config.json``
              (``model_cfg``, ``preprocess_cfg``) and ``open_clip_model.safetensors``, which
              ``open_clip.create_model_and_transforms("local-dir:model")`` and ``get_tokenizer`` load with
              nothing of eva_fastclip installed. It carries a Hugging Face text tower's config and tokenizer,
              and a timm trunk that only eva_fastclip registers as timm's own architecture with explicit
              arguments (``vision_trunk/config.json``). open_clip reads those two as paths from the working
              directory, so the config names them by the folder's absolute path: such a folder loads from
              where it was written (docs/checkpoints.md).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from eva_fastclip.checkpointing import checkpoint
from eva_fastclip.models import to_open_clip_state_dict

STATE_DICT_SUFFIXES = (".pt", ".pth")
TRUNK_DIR = "vision_trunk"  # a stand-in timm trunk's config.json, apart from a Hugging Face tower's


def read_client_state(folder: Path) -> dict[str, Any]:
    """DeepSpeed's model states of a checkpoint folder (the module, its JSON, our client state), read without
    an engine."""
    states = sorted(folder.glob("mp_rank_*_model_states.pt"))
    if not states:
        raise FileNotFoundError(f"{folder} holds no DeepSpeed model states (mp_rank_*_model_states.pt)")
    return checkpoint.load_file(states[0])


def trained_as(folder: Path) -> tuple[str | None, torch.dtype]:
    """The precision a checkpoint was trained in (bf16, fp16, fp32; None: not recorded) and the dtype its
    run held the module's weights in (bf16 / fp16 under DeepSpeed's bf16 / fp16, fp32 under autocast)."""
    states = sorted(folder.glob("mp_rank_*_model_states.pt"))
    module = checkpoint.load_file(states[0], mmap=True)["module"] if states else {}
    held = {t.dtype for t in module.values() if t.is_floating_point()}  # buffers stay fp32 beside them
    dtype = next((d for d in (torch.bfloat16, torch.float16) if d in held), torch.float32)
    return checkpoint.saved_precision(folder), dtype


def consolidated_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """The fp32 weights of a complete checkpoint, merged from the ZeRO partitions of every rank."""
    if not checkpoint.is_complete(folder):
        raise ValueError(f"{folder} has no {checkpoint.MARKER}: its save never finished; pick a complete one")
    state = read_client_state(folder)
    merged: dict[str, torch.Tensor] = {}
    if state.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0) > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        merged = get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)
    # the rest from the saved module: all of it at stage 0 (stored whole), and under ZeRO-1 the frozen
    # parameters (a fixed temperature, a locked text tower), of which it keeps no fp32 copy, not even the
    # shapes: they never change, so the module's copy is the trained value
    for key, value in state["module"].items():
        merged.setdefault(key, value.float())
    return merged


def export_open_clip(folder: Path, output: Path, verify: bool = True) -> dict[str, Any]:
    """Write ``output``: a state dict file for a ``.pt``/``.pth`` path, else open_clip's folder. With
    ``verify`` it is first loaded into open_clip with strict keys: an export that open_clip would not load
    never appears at ``output`` (it is written under a temporary name, then renamed)."""
    if output.suffix in STATE_DICT_SUFFIXES:
        return _export_state_dict(folder, output, verify)
    return _export_folder(folder, output, verify)


def _logit_bias_kwargs(state_dict: dict[str, torch.Tensor]) -> dict[str, float]:
    """open_clip's ``init_logit_bias`` for a model trained with one (SigLIP): the keyword that makes
    open_clip build the ``logit_bias`` parameter its weights fill (the trained value, so a config that
    carries it alone also says it)."""
    return {"init_logit_bias": state_dict["logit_bias"].item()} if "logit_bias" in state_dict else {}


def _export_state_dict(folder: Path, output: Path, verify: bool) -> dict[str, Any]:
    state_dict = to_open_clip_state_dict(consolidated_state_dict(folder))
    model_cfg = checkpoint.saved_settings(folder)["config"]["model"]
    arch = model_cfg["name"]
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    torch.save(state_dict, tmp)
    try:
        if verify:
            extra = _logit_bias_kwargs(state_dict)
            _verify_open_clip_load(tmp, arch, model_cfg.get("text_hf_model"), extra)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, output)
    return {"output": str(output), "format": "state dict", "architecture": arch, "tensors": len(state_dict)}


def _verify_open_clip_load(path: Path, arch: str, text_hf_model: str | None, extra: dict) -> None:
    import open_clip

    from eva_fastclip.models import text_towers  # (also registers the shipped architectures)

    # a Hugging Face text tower is not part of the architecture's name: rebuild it from its folder
    kwargs = (
        text_towers.hf_text_model_kwargs(arch, text_hf_model, load_weights=False) if text_hf_model else {}
    )
    open_clip.create_model(arch, pretrained=str(path), **kwargs, **extra)  # strict: raises on a stray key


def _export_folder(folder: Path, output: Path, verify: bool) -> dict[str, Any]:
    import open_clip
    import safetensors.torch
    from open_clip.constants import HF_CONFIG_NAME, HF_SAFE_WEIGHTS_NAME
    from open_clip.push_to_hf_hub import save_config_for_hf

    from eva_fastclip.models import text_towers  # (also registers the shipped architectures)

    output = output.resolve()  # the config may name files in the folder, by its absolute path
    if output.exists() and not (output / HF_CONFIG_NAME).is_file():
        raise ValueError(
            f"{output} exists and is no earlier export (no {HF_CONFIG_NAME} in it): choose a new "
            "path, or a .pt file for a state dict"
        )
    saved = checkpoint.saved_settings(folder)["config"]["model"]
    arch, text_hf_model = saved["name"], saved.get("text_hf_model")
    hf_kwargs = {}
    if text_hf_model is not None:
        if not (Path(text_hf_model) / "config.json").is_file():
            raise FileNotFoundError(
                f"the checkpoint's text tower came from the Hugging Face folder {text_hf_model}, which is "
                "gone: the export copies its config and tokenizer from there; restore it at that path"
            )
        hf_kwargs = text_towers.hf_text_model_kwargs(arch, text_hf_model, load_weights=False)
    # built as training built it (so its preprocess_cfg is the training one), then the trained weights
    state_dict = to_open_clip_state_dict(consolidated_state_dict(folder))
    bias = _logit_bias_kwargs(state_dict)
    model = open_clip.create_model(arch, pretrained_text=False, **hf_kwargs, **bias).eval()
    model.load_state_dict(state_dict, strict=True)

    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an export that was killed
    tmp.mkdir(parents=True)
    try:
        safetensors.torch.save_file(model.state_dict(), tmp / HF_SAFE_WEIGHTS_NAME)
        if text_hf_model is not None:  # what HFTextEncoder builds from and what get_tokenizer reads
            model.text.config.save_pretrained(tmp)
            context_length = hf_kwargs["text_cfg"]["context_length"]
            text_towers.hf_tokenizer(text_hf_model, context_length).save_pretrained(tmp)
        trunk = _write_trunk_standin(model, tmp)

        def write_config(home: Path) -> None:  # save_config_for_hf adds the model's preprocess_cfg
            model_cfg = standalone_model_config(arch, hf_kwargs.get("text_cfg"), trunk, home) | bias
            save_config_for_hf(model, tmp / HF_CONFIG_NAME, model_config=model_cfg)

        if verify:  # as it stands in the temporary folder, then its paths name the final one
            write_config(tmp)
            _verify_folder(tmp, model)
        write_config(output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if output.exists():  # an earlier export, replaced
        old = output.with_name(output.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(output, old)
        os.replace(tmp, output)
        shutil.rmtree(old)
    else:
        os.replace(tmp, output)
    tensors = len(model.state_dict())
    return {"output": str(output), "format": "open_clip folder", "architecture": arch, "tensors": tensors}


def _verify_folder(path: Path, model: torch.nn.Module) -> None:
    """open_clip loads the folder with strict keys, and its model computes what ``model`` does: a stand-in
    trunk or a Hugging Face config that built something else with the same tensor names would show here."""
    import open_clip

    reloaded = open_clip.create_model(f"local-dir:{path}").eval()  # strict: raises on an unmatched key
    tokens = open_clip.get_tokenizer(f"local-dir:{path}")(["a photo of a cat"])
    images = torch.randn(1, 3, *model.visual.image_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for encode in ("encode_image", "encode_text"):
            inputs = images if encode == "encode_image" else tokens
            # unit vectors: fresh towers' features are tiny (EVA scales its head init by 1e-3)
            ours = getattr(model, encode)(inputs, normalize=True)
            theirs = getattr(reloaded, encode)(inputs, normalize=True)
            difference = (ours - theirs).abs().max().item()
            if difference > 1e-5:
                raise ValueError(
                    f"open_clip's model from {path} differs from the trained one in {encode} (normalized "
                    f"features up to {difference:.3g} apart): the folder's model_cfg is wrong"
                )


def standalone_model_config(
    arch: str, hf_text_cfg: dict[str, Any] | None, trunk: bool, home: Path
) -> dict[str, Any]:
    """open_clip's ``model_cfg`` for ``arch`` that needs nothing of eva_fastclip: the architecture's own
    config, with a Hugging Face text tower's ``text_cfg`` read from ``home`` and a stand-in timm trunk
    (``trunk``) from ``home / TRUNK_DIR``."""
    import open_clip

    cfg = copy.deepcopy(open_clip.get_model_config(arch))
    if hf_text_cfg is not None:
        # HFTextEncoder reads its config from hf_model_name (get_tokenizer reads a local-dir folder itself,
        # whatever hf_tokenizer_name says); no Hugging Face weights: the CLIP weights file holds them
        cfg["text_cfg"] = dict(
            hf_text_cfg, hf_model_name=str(home), hf_tokenizer_name=str(home), hf_model_pretrained=False
        )
        cfg["custom_text"] = True
    if trunk:
        cfg["vision_cfg"]["timm_model_name"] = f"local-dir:{home / TRUNK_DIR}"
    return cfg


def _write_trunk_standin(model: torch.nn.Module, folder: Path) -> bool:
    """For a timm trunk that only eva_fastclip registers, write timm's local-dir config that builds it as
    timm's own architecture (eva.TIMM_STANDINS); False when the model needs none."""
    from eva_fastclip.models.eva import TIMM_STANDINS

    trunk = getattr(model.visual, "trunk", None)
    name = getattr(trunk, "pretrained_cfg", {}).get("architecture")
    if name not in TIMM_STANDINS:
        return False
    architecture, model_args = TIMM_STANDINS[name]
    data_cfg = {k: v for k, v in trunk.pretrained_cfg.items() if k != "architecture" and v is not None}
    (folder / TRUNK_DIR).mkdir()
    config = {"architecture": architecture, "model_args": model_args, "pretrained_cfg": data_cfg}
    (folder / TRUNK_DIR / "config.json").write_text(json.dumps(config, indent=2))
    return True
