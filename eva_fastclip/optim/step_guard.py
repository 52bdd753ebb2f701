"""Clipping and the non-finite guard inside the optimizer's step, where the optimizer steps the model's own
tensors (ZeRO-0 in fp32, or bf16 by autocast over fp32 weights: engine/setup.py).

DeepSpeed's ZeRO and bf16/fp16 wrappers take the global gradient norm, skip a step whose gradients are not
finite and clip, before they call the optimizer; without a wrapper DeepSpeed clips tensor by tensor and
applies a non-finite step. Here the optimizer does both itself, in two passes over the gradients:

1. the global norm: one multi-tensor norm (a norm per tensor) and the norm of those, on the device (on a
   CPU a dot product per tensor, twice as fast there);
2. the clip: every gradient times min(1, max_norm / (norm + 1e-6)) (DeepSpeed's and torch's coefficient),
   a device scalar the optimizer applies: one multi-tensor multiply (our LAMB on a GPU), inside its
   passes (our LAMB on a CPU: optim/lamb_fused_cpu.py, optim/lamb_passes.py), or as fused AdamW's
   ``grad_scale`` (no pass of its own).

A step whose norm is not finite is not taken: ``overflow`` is True, as DeepSpeed's wrappers report a
skipped step, so ``engine.was_step_applied()`` is False, the schedule does not advance and the trainer's
guard (reliability/bad_steps.py) counts it. Telling the engine so is the step's one wait for the device.
"""

from __future__ import annotations

import torch

#: added to the norm before dividing, as DeepSpeed's clip and torch's clip_grad_norm_ add it
CLIP_EPS = 1e-6


class GradientGuard:
    """The global norm of a step's gradients and what follows from it: the clip coefficient (``max_norm``
    0: none) and whether the step may be taken."""

    def __init__(self, max_norm: float) -> None:
        if max_norm < 0:
            raise ValueError(f"gradient clipping needs max_norm >= 0, got {max_norm}")
        self.max_norm = max_norm
        self.norm: torch.Tensor | None = None  # the last step's global gradient norm, on the device

    def inspect(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        """The global norm of ``grads`` (kept in :attr:`norm`); returns the clip coefficient as a device
        scalar, or None without clipping."""
        dtype = torch.promote_types(grads[0].dtype, torch.float32)  # fp32 at least, float64 stays
        if grads[0].device.type == "cpu":  # a dot product per tensor: half the time of a CPU norm kernel
            flat = [g.reshape(-1) for g in grads]
            self.norm = torch.stack([torch.dot(g, g).to(dtype) for g in flat]).sum().sqrt()
        else:
            norms = torch._foreach_norm(grads)
            self.norm = torch.linalg.vector_norm(torch.stack([n.to(dtype) for n in norms]))
        if not self.max_norm:
            return None
        return (self.max_norm / (self.norm + CLIP_EPS)).clamp_(max=1.0)

    def finite(self) -> bool:
        """Whether the last norm was finite (every gradient finite): reads it from the device."""
        return self.norm is None or bool(torch.isfinite(self.norm))


class GuardedStep:
    """For an optimizer class: :meth:`guard_gradients` turns on clipping and the non-finite guard in its
    ``step``, and ``overflow`` / ``_global_grad_norm`` are what DeepSpeed's engine reads after a step (it
    counts an overflow as a skipped step and keeps the norm for ``get_global_grad_norm``)."""

    _guard: GradientGuard | None = None
    overflow = False

    def guard_gradients(self, max_norm: float) -> None:
        """Clip by the global norm at ``max_norm`` (0: never) and skip non-finite steps, in ``step``."""
        self._guard = GradientGuard(max_norm)

    @property
    def _global_grad_norm(self) -> torch.Tensor | None:
        return None if self._guard is None else self._guard.norm

    def _gradients(self) -> list[torch.Tensor]:
        return [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]  # type: ignore[attr-defined]
