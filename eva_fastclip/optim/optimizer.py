"""The optimizer over our parameter groups: LAMB (trust ratio per tensor) or AdamW, the same update on
CUDA and CPU."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import torch
from torch import nn

from eva_fastclip.config import ConfigError, OptimConfig
from eva_fastclip.optim.adamw import AdamW
from eva_fastclip.optim.param_groups import parameter_groups

log = logging.getLogger(__name__)

#: FusedLamb's own settings that optimizer.params may hold for "Lamb"; both devices get them.
LAMB_PARAMS = ("bias_correction", "eps_inside_sqrt", "max_coeff", "min_coeff")


def build_optimizer(
    ds: dict[str, Any],
    model: nn.Module,
    optim: OptimConfig,
    *,
    cuda: bool,
    temperature_lr: float | None = None,
) -> torch.optim.Optimizer:
    """LAMB / AdamW over our parameter groups, the same updates on CUDA and CPU.

    ``ds`` is the resolved DeepSpeed JSON: its lr is the optimizer's default, while each group carries its
    own peak lr and weight decay from ``optim`` (per tower, per layer), which the schedule multiplies.
    LAMB is our ``Lamb`` (FusedLamb's update in PyTorch ops, trust ratio per model tensor once
    :func:`initialize_engine` has attached the ZeRO partitions); with ``optim.lamb_trust_ratio =
    "per_zero_partition"`` it is DeepSpeed's FusedLamb on CUDA, and our ``Lamb`` left per flat partition
    elsewhere. A group with ``trust_ratio`` False (the temperature, unless ``optim.temperature_trust_ratio``)
    gets the trust-ratio bounds max_coeff = min_coeff = 1, which both read per group: an Adam step.
    AdamW is PyTorch's fused AdamW on either device (it resumes DeepSpeed FusedAdam's state).
    """
    kind = ds["optimizer"]["type"]
    params = dict(ds["optimizer"]["params"])
    lr, weight_decay = params.pop("lr"), params.pop("weight_decay")
    if (lr, weight_decay) != (optim.lr, optim.weight_decay):
        raise ConfigError(
            f"DeepSpeed optimizer.params lr={lr}, weight_decay={weight_decay} differ from optim.lr="
            f"{optim.lr}, optim.weight_decay={optim.weight_decay}: pass the config through "
            "resolve_deepspeed_config first"
        )
    groups = parameter_groups(model, optim, temperature_lr=temperature_lr)
    betas = tuple(params.pop("betas", (0.9, 0.98)))
    eps = params.pop("eps", 1e-6)
    lamb_args = {key: params.pop(key) for key in LAMB_PARAMS if kind == "Lamb" and key in params}
    if params:
        allowed = ["betas", "eps", *(LAMB_PARAMS if kind == "Lamb" else ())]
        raise ConfigError(
            f"optimizer.params has keys eva_fastclip does not pass on to {kind}: {sorted(params)} "
            f"(it takes lr, weight_decay, {', '.join(allowed)}; the gradient is clipped by gradient_clipping)"
        )
    for group in groups:
        if not group.pop("trust_ratio", True) and kind == "Lamb":
            group.update(max_coeff=1.0, min_coeff=1.0)
    if kind == "Lamb":
        if cuda and optim.lamb_trust_ratio == "per_zero_partition":
            from deepspeed.ops.lamb import FusedLamb as Lamb

            _buildable_cuda_arch_list()
        else:
            from eva_fastclip.optim.lamb import Lamb
        optimizer = Lamb(groups, lr=lr, betas=betas, eps=eps, **lamb_args)
        _keep_trust_ratio_bounds(optimizer)
        return optimizer
    # PyTorch's fused AdamW kernel on either device: one pass over the weights (optim/adamw.py)
    return AdamW(groups, lr=lr, betas=betas, eps=eps)


def base_cuda_archs(arch_list: str) -> str:
    """TORCH_CUDA_ARCH_LIST with each arch-specific entry as its base arch: ``9.0a`` -> ``9.0``."""
    return re.sub(r"(\d+\.\d+)[a-z](?=\+|;|\s|$)", r"\1", arch_list)


def _buildable_cuda_arch_list() -> None:
    """DeepSpeed 0.19.8's just-in-time build of its fused optimizers reads TORCH_CUDA_ARCH_LIST as
    MAJOR.MINOR[+PTX] and fails on an arch-specific entry such as ``9.0a`` (``int('0a')``), which CUDA images
    for H100 / H200 set. Those kernels use no arch-specific instruction: build them for the base arch."""
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    base = base_cuda_archs(arch_list)
    if base != arch_list:
        log.warning(
            "TORCH_CUDA_ARCH_LIST=%s: DeepSpeed's kernel build cannot read arch-specific entries; building "
            "its fused optimizer for %s",
            arch_list,
            base,
        )
        os.environ["TORCH_CUDA_ARCH_LIST"] = base


def _keep_trust_ratio_bounds(optimizer: torch.optim.Optimizer) -> None:
    """Loading optimizer state replaces each group's settings with the saved ones; the trust-ratio bounds
    must stay the config's, or a checkpoint from before a change of optim.temperature_trust_ratio (or from
    before the key existed) would silently bring the old temperature step back."""
    bounds = [(g["max_coeff"], g["min_coeff"]) for g in optimizer.param_groups]

    def restore(opt: torch.optim.Optimizer) -> None:
        for group, (high, low) in zip(opt.param_groups, bounds, strict=True):
            group.update(max_coeff=high, min_coeff=low)

    optimizer.register_load_state_dict_post_hook(restore)
