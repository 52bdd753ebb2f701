"""EVA vision towers: load EVA MIM checkpoints into open_clip's timm ``Eva`` trunk, never silently.

open_clip's EVA models (``EVA02-B-16``, ``EVA02-L-14``, ``EVA01-g-14``, ...) keep a timm ``Eva`` at
``model.visual.trunk``. :func:`load_vision_checkpoint` reads a local checkpoint in one of these formats:

``eva02``      the EVA repository's EVA-02 MIM state dicts (``attn.q_proj`` + ``q_bias``/``v_bias``,
               ``mlp.w1/w2/w3``, ``mlp.ffn_ln``, ``rope.*``, MIM-only ``lm_head``/``mask_token``);
``eva01``      EVA-01 (giant): fused ``attn.qkv`` + ``q_bias``/``v_bias``, ``mlp.fc1/fc2`` (timm's names too);
``timm``       timm eva/eva02 state dicts (e.g. ``eva02_base_patch14_224.mim_in22k``, ``.safetensors`` too);
``open_clip``  a whole open_clip checkpoint: only the ``visual.trunk.*`` keys are used;
``eva_clip``   a whole EVA-CLIP checkpoint (``visual.*`` in EVA names): only the ``visual.*`` keys are used.

Renaming and resampling (``pos_embed`` bicubic with the prefix tokens kept, ``patch_embed.proj`` 14->16) are
timm's ``checkpoint_filter_fn``; this module adds unwrapping, dropping the pretraining-only tensors, matching
the final norm to the trunk, and the checks. RoPE tables are non-persistent buffers of the trunk, rebuilt from
its own config (grid, ``ref_feat_shape``), so the checkpoint's ``rope.*`` tensors are dropped.

Missing trunk keys that are tolerated (left at their init, listed in the report):

* ``head.*``: in open_clip's EVA towers (``timm_proj: null``) the trunk head is the CLIP projection, which a
  MIM checkpoint cannot have; also a classifier head in other trunks.
* ``norm.*`` / ``fc_norm.*``: the final (or pooled) LayerNorm, when the checkpoint has neither.
* ``blocks.N.attn.norm.*``: the attention sub-LN that EVA-CLIP adds (timm ``scale_attn_inner``), when the
  checkpoint has it in no block at all: EVA-02 MIM models have none, and EVA-CLIP starts it at LayerNorm's
  identity init. A checkpoint that has it in some blocks but not others fails.
* ``attn_pool.*``: an attention-pooling head, never part of a MIM backbone.

Everything else missing (any other ``blocks.*`` tensor, ``patch_embed``, ``pos_embed``, ``cls_token``, ...),
any backbone tensor in the checkpoint that the trunk has no place for (e.g. deeper checkpoint), and any
shape mismatch raise ``ValueError``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from timm.data import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.eva import Eva, checkpoint_filter_fn

from eva_fastclip.config import ConfigError
from eva_fastclip.models.weights_file import read_weights

_logger = logging.getLogger(__name__)

BACKBONE_PREFIXES = ("blocks.", "patch_embed.", "pos_embed", "cls_token", "reg_token", "norm_pre.")
# pretraining-only tensors of MIM checkpoints: the masked-token embedding and the prediction head
MIM_ONLY_PREFIXES = ("lm_head.", "mask_token")
RESAMPLED_KEYS = ("pos_embed", "patch_embed.proj.weight")
_ATTN_SUBLN = re.compile(r"^blocks\.\d+\.attn\.norm\.(weight|bias)$")
_TOLERATED_MISSING = re.compile(r"^(head|norm|fc_norm|attn_pool)\.")


@dataclass
class VisionLoadReport:
    """What :func:`load_vision_checkpoint` did; it only returns when every backbone tensor was loaded."""

    path: str
    source_format: str
    wrappers: list[str] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    """Trunk keys left at their init; only the tolerated ones (see the module docstring)."""
    unexpected: list[str] = field(default_factory=list)
    """Non-backbone checkpoint keys the trunk has no place for (ignored)."""
    dropped: list[str] = field(default_factory=list)
    """Checkpoint keys dropped on purpose: MIM heads, classifier head, RoPE buffers."""
    resampled: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    """Key -> (checkpoint shape, trunk shape) for pos_embed / patch_embed.proj.weight."""
    renamed: dict[str, str] = field(default_factory=dict)
    """Checkpoint-side name -> trunk name for the final norm when the two disagree (norm <-> fc_norm)."""

    def summary(self) -> str:
        """One readable paragraph for the log."""
        lines = [
            f"vision checkpoint {self.path} ({self.source_format}"
            + (f", unwrapped {'/'.join(self.wrappers)}" if self.wrappers else "")
            + f"): loaded {len(self.loaded)} tensors"
        ]
        for name, (old, new) in self.resampled.items():
            lines.append(f"  resampled {name} {list(old)} -> {list(new)}")
        for old, new in self.renamed.items():
            lines.append(f"  {old} loaded into {new}")
        if self.missing:
            lines.append(f"  left at init ({len(self.missing)}): {_abbrev(self.missing)}")
        if self.dropped:
            lines.append(f"  dropped ({len(self.dropped)}): {_abbrev(self.dropped)}")
        if self.unexpected:
            lines.append(f"  ignored, not in the trunk ({len(self.unexpected)}): {_abbrev(self.unexpected)}")
        return "\n".join(lines)


def _abbrev(keys: list[str], limit: int = 8) -> str:
    return ", ".join(keys[:limit]) + (f", ... (+{len(keys) - limit})" if len(keys) > limit else "")


def detect_format(state: Mapping[str, torch.Tensor]) -> tuple[str, str]:
    """(format name, key prefix of the vision backbone) of a flat state dict; ``unknown`` if not EVA."""
    if "visual.trunk.pos_embed" in state or any(k.startswith("visual.trunk.blocks.") for k in state):
        return "open_clip", "visual.trunk."
    prefix = "visual." if "visual.pos_embed" in state and "visual.blocks.0.norm1.weight" in state else ""
    has = {k[len(prefix) :] for k in state if k.startswith(prefix + "blocks.0.")}
    if prefix:
        return "eva_clip", prefix
    if "blocks.0.attn.q_proj.weight" in has:
        eva_names = {"blocks.0.attn.q_bias", "blocks.0.mlp.w1.weight", "blocks.0.mlp.w12.weight"}
        return ("eva02" if has & eva_names else "timm"), ""
    if "blocks.0.attn.qkv.weight" in has and "blocks.0.mlp.fc1.weight" in has:
        return "eva01", ""
    if "blocks.0.mlp.fc1_g.weight" in has or "blocks.0.mlp.fc1.weight" in has:
        return "timm", ""
    return "unknown", ""


def _is_backbone(key: str) -> bool:
    return key.startswith(BACKBONE_PREFIXES)


def load_vision_checkpoint(trunk: Eva, path: str | Path) -> VisionLoadReport:
    """Load an EVA MIM / timm / open_clip vision checkpoint into a timm ``Eva`` trunk, in place.

    Raises ``ValueError`` (naming the file, the detected format and the keys) when any backbone tensor did
    not load, when the checkpoint has backbone tensors the trunk cannot take, or when a shape differs after
    resampling. Tolerated gaps are listed in the returned report (see the module docstring).
    """
    if not isinstance(trunk, Eva):
        raise ValueError(f"load_vision_checkpoint needs a timm Eva trunk, got {type(trunk).__name__}")
    weights = read_weights(path)
    raw, wrappers = weights.tensors, weights.wrappers
    fmt, prefix = detect_format(raw)
    report = VisionLoadReport(path=str(path), source_format=fmt, wrappers=wrappers)
    target = trunk.state_dict()

    # only the vision backbone of whole-CLIP checkpoints; the text tower is not ours to load here
    state = {k[len(prefix) :]: v for k, v in raw.items() if k.startswith(prefix)}
    # the CLIP projection lives in trunk.head only in whole-CLIP formats; elsewhere `head` is a classifier
    keep_head = fmt in ("open_clip", "eva_clip")
    kept = {}
    for k, v in state.items():
        if (
            k.startswith(MIM_ONLY_PREFIXES)
            or (k.startswith("rope.") and k not in target)
            or (k.startswith("head.") and not keep_head)
        ):
            report.dropped.append(prefix + k)
        else:
            kept[k] = v
    for k in RESAMPLED_KEYS:  # bicubic resampling of half-precision tensors is not supported on CPU
        if k in kept and kept[k].is_floating_point():
            kept[k] = kept[k].float()

    # an unknown layout bypasses timm's filter, which could misread it (e.g. an open_clip ViT as Meta PE)
    converted = dict(kept) if fmt == "unknown" else checkpoint_filter_fn(dict(kept), trunk)
    for k in RESAMPLED_KEYS:
        if k in converted and k in kept and converted[k] is not kept[k]:
            report.resampled[k] = (tuple(kept[k].shape), tuple(converted[k].shape))
    _match_final_norm(converted, target, report)

    missing = [k for k in target if k not in converted]
    unexpected = [k for k in converted if k not in target]
    source_has_subln = any(_ATTN_SUBLN.match(k) for k in converted)
    fatal_missing = [
        k
        for k in missing
        if not (_TOLERATED_MISSING.match(k) or (_ATTN_SUBLN.match(k) and not source_has_subln))
    ]
    fatal_unexpected = [k for k in unexpected if _is_backbone(k)]
    wrong_shape = [
        f"{k} {list(converted[k].shape)} vs trunk {list(target[k].shape)}"
        for k in converted
        if k in target and converted[k].shape != target[k].shape
    ]
    if fatal_missing or fatal_unexpected or wrong_shape:
        problems = []
        if fatal_missing:
            blocks_first = sorted(fatal_missing, key=lambda k: not k.startswith("blocks."))
            missing_text = _abbrev(blocks_first)
            problems.append(f"{len(fatal_missing)} trunk tensors not in the checkpoint: {missing_text}")
        if fatal_unexpected:
            problems.append(
                f"{len(fatal_unexpected)} checkpoint backbone tensors with no place in the trunk: "
                f"{_abbrev(fatal_unexpected)}"
            )
        if wrong_shape:
            problems.append(f"{len(wrong_shape)} shape mismatches: {_abbrev(wrong_shape, 4)}")
        raise ValueError(
            f"vision checkpoint {path} (detected format {fmt!r}) does not fit the "
            f"{type(trunk).__name__} trunk ({len(trunk.blocks)} blocks, width {trunk.embed_dim}): "
            + "; ".join(problems)
        )

    loadable = {k: v for k, v in converted.items() if k in target}
    result = trunk.load_state_dict(loadable, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys  # filtered above: would be a bug here
    report.loaded = sorted(loadable)
    report.missing = sorted(result.missing_keys)
    report.unexpected = sorted(unexpected)
    return report


def _match_final_norm(converted: dict, target: Mapping, report: VisionLoadReport) -> None:
    """Put the checkpoint's final LayerNorm where the trunk has one.

    MIM checkpoints call it ``norm``; timm moves it to ``fc_norm`` for avg-pool trunks, while open_clip's EVA
    towers pool the CLS token after ``norm``. Either way it is the same last LayerNorm.
    """
    for src, dst in (("norm", "fc_norm"), ("fc_norm", "norm")):
        if f"{src}.weight" in converted and f"{src}.weight" not in target and f"{dst}.weight" in target:
            if f"{dst}.weight" in converted:
                continue
            for suffix in (".weight", ".bias"):
                if src + suffix in converted:
                    converted[dst + suffix] = converted.pop(src + suffix)
            report.renamed[src] = dst


# -- tiny EVA-02 CLIP trunk for tests and the demo (open_clip config: configs/test-eva02-xs.json) --

TEST_XS_ARGS = dict(
    img_size=32,
    patch_size=8,
    embed_dim=32,
    depth=2,
    num_heads=2,
    qkv_fused=False,
    mlp_ratio=4 * 2 / 3,
    swiglu_mlp=True,
    scale_mlp=True,
    scale_attn_inner=True,
    use_rot_pos_emb=True,
    ref_feat_shape=(4, 4),
)
# Our trunks as timm's own architecture with every argument of its entry point given: an export writes them
# so, to build where eva_fastclip is not installed (export.py).
TIMM_STANDINS = {"eva02_test_xs_patch8_clip_32": ("eva02_base_patch16_clip_224", TEST_XS_ARGS)}

default_cfgs = generate_default_cfgs(
    {
        "eva02_test_xs_patch8_clip_32": {
            "num_classes": 0,
            "input_size": (3, 32, 32),
            "pool_size": None,
            "crop_pct": 1.0,
            "interpolation": "bicubic",
            "fixed_input_size": True,
            "mean": OPENAI_CLIP_MEAN,
            "std": OPENAI_CLIP_STD,
            "first_conv": "patch_embed.proj",
            "classifier": "head",
            "license": "mit",
        }
    }
)


@register_model
def eva02_test_xs_patch8_clip_32(pretrained: bool = False, **kwargs) -> Eva:
    """A 2-block, width-32 EVA-02 CLIP trunk like eva02_base_patch16_clip_224 (RoPE, SwiGLU, sub-LNs)."""
    if pretrained:
        raise ValueError("eva02_test_xs_patch8_clip_32 is a test architecture without pretrained weights")
    model_args = dict(
        TEST_XS_ARGS,
        global_pool=kwargs.pop("global_pool", "token"),
        num_classes=kwargs.pop("num_classes", 0),
    )
    return build_model_with_cfg(
        Eva,
        "eva02_test_xs_patch8_clip_32",
        pretrained=False,
        pretrained_filter_fn=checkpoint_filter_fn,
        **dict(model_args, **kwargs),
    )


def find_eva_trunk(model: torch.nn.Module) -> Eva:
    """The timm ``Eva`` at ``model.visual.trunk`` of an open_clip model; ConfigError if there is none."""
    trunk = getattr(getattr(model, "visual", None), "trunk", None)
    if not isinstance(trunk, Eva):
        found = type(getattr(model, "visual", None)).__name__
        raise ConfigError(
            f"model.vision_checkpoint needs an architecture whose vision tower is a timm EVA trunk "
            f"(EVA02-B-16, EVA02-L-14, EVA01-g-14, test-eva02-xs, ...); this model's visual is {found}"
            + (f" with a {type(trunk).__name__} trunk" if trunk is not None else "")
        )
    return trunk


def load_vision_tower(model: torch.nn.Module, path: str | Path) -> VisionLoadReport:
    """Load ``path`` into ``model.visual.trunk`` (see :func:`load_vision_checkpoint`) and log the report."""
    report = load_vision_checkpoint(find_eva_trunk(model), path)
    _logger.info(report.summary())
    return report
