"""The temperature controller: one component for every rule of SPEC.md's table.

Global rules act on the model's parameter theta = log(1/tau) (open_clip's ``logit_scale``):
- ``fixed``: theta is frozen.
- ``learnable`` (OpenCLIP, FastCLIP-v0): theta learns through the loss, with the model's lr and schedule.
- ``rgcl_g`` (FastCLIP-v3): theta learns through the RGCL-g surrogate in its own optimizer group (no
  weight decay, constant lr ``temperature_lr``), and that lr is multiplied by ``temperature_lr_drop_factor``
  while tau <= ``temperature_lr_drop_below``. FastCLIP's scheduler checks tau before every step, so the lr
  goes back up if tau climbs above the threshold (``temperature_lr_drop_rule: every_step``, the default);
  ``once`` keeps it dropped from the first time (SPEC's wording). The loss decides theta's gradient
  (``tau_gradient``: FastCLIP's code or the exact one).
After every applied step the global tau is clamped to [temperature_min, temperature_max].

Individual rules keep tau_i per sample in the loss's per-sample table and step it inside the loss with
``individual_step`` (a pure function of tensors): Adam-like (FastCLIP-v2) or momentum (iSogCLR).
The controller knows nothing of DeepSpeed: the trainer gives it the parameter's value and a setter.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from eva_fastclip.config import LossConfig


@dataclass
class TemperatureController:
    rule: str
    init: float
    min: float
    max: float
    lr: float | None
    lr_drop_below: float | None
    lr_drop_factor: float
    lr_drop_rule: str
    betas: tuple[float, float]
    momentum: float
    grad_clip: float
    lr_dropped: bool = False

    @classmethod
    def from_config(cls, cfg: LossConfig) -> TemperatureController:
        return cls(
            rule=cfg.temperature_rule,
            init=cfg.temperature_init,
            min=cfg.temperature_min,
            max=cfg.temperature_max,
            lr=cfg.temperature_lr,
            lr_drop_below=cfg.temperature_lr_drop_below,
            lr_drop_factor=cfg.temperature_lr_drop_factor,
            lr_drop_rule=cfg.temperature_lr_drop_rule,
            betas=tuple(cfg.temperature_betas),
            momentum=cfg.temperature_momentum,
            grad_clip=cfg.temperature_grad_clip,
        )

    # ---- global temperature ---------------------------------------------------------------------------

    @property
    def is_individual(self) -> bool:
        return self.rule.startswith("individual")

    @property
    def learns_global(self) -> bool:
        """Whether the model's logit_scale gets gradients."""
        return self.rule in ("learnable", "rgcl_g")

    @property
    def own_group_lr(self) -> float | None:
        """lr of the temperature's own constant-lr optimizer group, or None to share the model's groups."""
        return self.lr if self.rule == "rgcl_g" else None

    def logit_scale_bounds(self) -> tuple[float, float]:
        """[min, max] of tau as bounds on theta = log(1/tau)."""
        return math.log(1.0 / self.max), math.log(1.0 / self.min)

    def after_applied_step(
        self, theta: float, set_theta: Callable[[float], None], set_group_lr: Callable[[float], None] | None
    ) -> float:
        """Clamp the global tau and set rgcl_g's lr for the next step from it; returns tau.

        Call after every applied step, and once before the first step (a start or resume at a tau at or
        below the threshold trains its first step at the dropped lr, as FastCLIP's scheduler does).
        ``set_group_lr`` is called only when the lr changes; ``lr_dropped`` says whether it is dropped.
        """
        if not self.learns_global:
            return math.exp(-theta)
        low, high = self.logit_scale_bounds()
        if not low <= theta <= high:
            theta = min(max(theta, low), high)
            set_theta(theta)
        tau = math.exp(-theta)
        if self.rule == "rgcl_g":
            # (a resumed run may have no threshold any more: its lr goes back up)
            below = self.lr_drop_below is not None and tau <= self.lr_drop_below
            kept = self.lr_dropped and self.lr_drop_rule == "once" and self.lr_drop_below is not None
            dropped = below or kept
            if dropped != self.lr_dropped:
                self.lr_dropped = dropped
                if set_group_lr is not None:
                    set_group_lr(self.lr * (self.lr_drop_factor if dropped else 1.0))
        return tau

    def state_dict(self) -> dict:
        return {"lr_dropped": self.lr_dropped}

    def load_state_dict(self, state: dict) -> None:
        self.lr_dropped = bool(state.get("lr_dropped", False))

    # ---- individual temperatures ----------------------------------------------------------------------

    def individual_step(
        self, tau: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor | None, epoch: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One update of per-sample temperatures from their gradients; returns (tau, m, v).

        individual_adam: FastCLIP-v2's update as its loss.py writes it: both betas are 0 in the first
        epoch (m = grad, v = grad², a step of lr·sign(grad)), then ``betas``; m and v are divided by
        1 - beta^(epoch + 1), the sample's visit count (each sample is seen once an epoch), and the step is
        lr·m_hat/(sqrt(v_hat) + 1e-8). docs/losses.md says what this does to the step size after epoch 0.
        individual_momentum: m <- momentum*m + (1-momentum)*grad; tau <- tau - lr*m (iSogCLR).
        """
        grad = grad.clamp(-self.grad_clip, self.grad_clip)
        if self.rule == "individual_adam":
            beta1, beta2 = self.betas if epoch > 0 else (0.0, 0.0)
            m = beta1 * m + (1 - beta1) * grad
            v = beta2 * v + (1 - beta2) * grad.square()
            m_hat = m / (1 - beta1 ** (epoch + 1))
            v_hat = v / (1 - beta2 ** (epoch + 1))
            step = m_hat / (v_hat.sqrt() + 1e-8)
        elif self.rule == "individual_momentum":
            m = self.momentum * m + (1 - self.momentum) * grad
            step = m
        else:
            raise ValueError(f"individual_step called for the global rule {self.rule!r}")
        return (tau - self.lr * step).clamp(self.min, self.max), m, v
