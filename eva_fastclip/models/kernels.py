"""Fast kernels, each with a fallback, and a one-line report of what is in use.

- Attention is PyTorch's SDPA everywhere: timm's EVA trunks call ``F.scaled_dot_product_attention``
  (``fused_attn``), open_clip's towers ``nn.MultiheadAttention``, which uses it too. On CUDA SDPA picks its
  flash or memory-efficient kernels. When the flash-attn package is installed (FA3 as
  ``flash_attn_interface``, FA4 as ``flash_attn.cute``), PyTorch's dispatcher is pointed at it with
  ``torch.nn.attention.activate_flash_attention_impl``, so the same SDPA calls run flash-attn's kernels
  and no model code changes.
- LayerNorm: NVIDIA apex's ``FusedLayerNorm`` replaces ``nn.LayerNorm`` modules when NVIDIA apex (with
  its CUDA extension) is installed and the model trains on CUDA. The PyPI package named ``apex`` is an
  unrelated project: detection requires apex's compiled ``fused_layer_norm_cuda`` module, which only
  NVIDIA apex builds.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

log = logging.getLogger(__name__)

# flash-attn's kernels that PyTorch's dispatcher can adopt, newest first: (impl name, module path)
_FLASH_IMPLS = (("FA4", "flash_attn.cute.interface"), ("FA3", "flash_attn_interface"))


@dataclass
class KernelReport:
    attention: str
    layer_norm: str
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        notes = f" ({'; '.join(self.notes)})" if self.notes else ""
        return f"kernels: attention={self.attention}, layer_norm={self.layer_norm}{notes}"


def _module_exists(path: str) -> bool:
    try:
        return importlib.util.find_spec(path) is not None
    except (ImportError, ValueError):  # a missing parent package
        return False


def nvidia_apex_layer_norm() -> type[nn.Module] | None:
    """NVIDIA apex's FusedLayerNorm class, or None (not installed, built without CUDA, or PyPI's "apex")."""
    if not _module_exists("apex") or not _module_exists("fused_layer_norm_cuda"):
        return None
    try:
        from apex.normalization import FusedLayerNorm
    except ImportError:
        return None
    return FusedLayerNorm


def flash_attn_impl() -> tuple[str, str] | None:
    """(impl, module) of an installed flash-attn build that PyTorch's SDPA can dispatch to, or None."""
    for impl, module in _FLASH_IMPLS:
        if _module_exists(module):
            return impl, module
    return None


def replace_layer_norms(model: nn.Module, factory: Callable[[nn.LayerNorm], nn.Module]) -> int:
    """Swap every ``nn.LayerNorm`` (subclasses included) for ``factory(old)``; returns how many.

    Call before the optimizer is built: the new modules' parameters are the ones that get trained.
    """
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.LayerNorm)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, factory(child))
    return len(swaps)


def _apex_copy(cls: type[nn.Module]) -> Callable[[nn.LayerNorm], nn.Module]:
    def make(old: nn.LayerNorm) -> nn.Module:
        new = cls(old.normalized_shape, eps=old.eps, elementwise_affine=old.elementwise_affine)
        if old.elementwise_affine:
            new.load_state_dict(old.state_dict())
            for fresh, kept in zip(new.parameters(), old.parameters()):
                fresh.requires_grad_(kept.requires_grad)  # a locked tower stays locked
        return new.to(old.weight.device if old.weight is not None else "cpu")

    return make


def configure_kernels(model: nn.Module, device: torch.device) -> KernelReport:
    """Choose the fastest available kernels for ``model`` on ``device`` and say which ones were chosen."""
    notes: list[str] = []
    unfused = sum(1 for m in model.modules() if getattr(m, "fused_attn", True) is False)
    if unfused:  # timm honours TIMM_FUSED_ATTN=0 and some export modes
        notes.append(f"{unfused} timm attention modules run unfused (TIMM_FUSED_ATTN?)")
    attention = "sdpa"
    if device.type == "cuda":
        attention = "sdpa (flash / memory-efficient)"
        flash = flash_attn_impl()
        if flash is not None:
            try:
                torch.nn.attention.activate_flash_attention_impl(flash[0])
                attention = f"sdpa -> flash-attn {flash[0]} ({flash[1]})"
            except Exception as err:  # an incompatible build: PyTorch's own kernels still work
                notes.append(f"flash-attn {flash[0]} found but not activated: {err}")
        else:
            notes.append("flash-attn not installed")
    layer_norm = "torch"
    apex_norm = nvidia_apex_layer_norm()
    if apex_norm is not None and device.type == "cuda":
        count = replace_layer_norms(model, _apex_copy(apex_norm))
        layer_norm = f"apex FusedLayerNorm ({count} modules)"
    elif apex_norm is None:
        notes.append("NVIDIA apex not installed")
    return KernelReport(attention, layer_norm, notes)
