"""Token masking (FLIP patch dropout) switched at run time, for EVA-CLIP's optional unmasked final phase.

open_clip's own towers drop patches with ``open_clip.transformer.PatchDropout`` and timm's EVA trunks with
``PatchDropoutWithIndices`` (which also drops the matching RoPE rows); both read their ``prob`` attribute
on every call and do nothing in eval mode, so changing ``prob`` is all it takes.
"""

from __future__ import annotations

from torch import nn


def patch_dropout_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that drop patch tokens in ``model`` (open_clip's and timm's)."""
    return [m for m in model.modules() if type(m).__name__ in ("PatchDropout", "PatchDropoutWithIndices")]


def set_patch_dropout(model: nn.Module, prob: float) -> int:
    """Set the fraction of patch tokens dropped in training; returns how many modules changed."""
    if not 0.0 <= prob < 1.0:
        raise ValueError(f"patch dropout must be in [0, 1), got {prob}")
    modules = patch_dropout_modules(model)
    for module in modules:
        module.prob = prob
    return len(modules)
