"""Optimizer parameter groups: weight decay only on weight matrices."""

from __future__ import annotations

from torch import nn

# Substrings of parameter names that are embeddings or the temperature: never decayed (EVA-CLIP, OpenCLIP).
_NO_DECAY_NAMES = ("logit_scale", "logit_bias", "embedding", "pos_embed", "cls_token", "class_embedding")


def decays(name: str, param: nn.Parameter) -> bool:
    """True for weight matrices; biases, norm gains (all 1-D), embeddings and the temperature are excluded."""
    return param.ndim >= 2 and not any(part in name for part in _NO_DECAY_NAMES)


def parameter_groups(
    model: nn.Module, weight_decay: float, temperature_lr: float | None = None
) -> list[dict]:
    """decay / no_decay groups; with ``temperature_lr`` the logit_scale gets a group of its own at that lr
    (FastCLIP-v3's temperature is stepped by its own optimizer group, without weight decay)."""
    decay, no_decay, temperature = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if temperature_lr is not None and name == "logit_scale":
            temperature.append(param)
        else:
            (decay if decays(name, param) else no_decay).append(param)
    groups = [
        {"name": "decay", "params": decay, "weight_decay": weight_decay},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
        {"name": "temperature", "params": temperature, "weight_decay": 0.0, "lr": temperature_lr},
    ]
    return [g for g in groups if g["params"]]
