"""AdamW: PyTorch's fused kernel (one pass over the weights, CUDA and CPU), with the clip and the non-finite
guard folded into that pass (optim/step_guard.py).

The fused kernel takes ``grad_scale`` (it divides every gradient by it as it reads it) and ``found_inf``
(a device flag: where it is set, nothing moves and the step counts stay). The clip coefficient c becomes
``grad_scale = 1 / c``, and a non-finite global norm sets ``found_inf``: the step after the backward is one
norm pass and the kernel's pass, with no wait for the device until the engine asks whether the step was
taken (``overflow``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from eva_fastclip.optim.step_guard import GuardedStep


class AdamW(GuardedStep, torch.optim.AdamW):
    """``torch.optim.AdamW(fused=True)``; under :meth:`guard_gradients` it clips and skips non-finite steps
    itself. Loads DeepSpeed FusedAdam's state too (its step count is a Python int, the kernel's a tensor)."""

    def __init__(self, params, **kwargs: Any) -> None:
        super().__init__(params, fused=True, **kwargs)
        self.register_load_state_dict_pre_hook(_steps_as_tensors)
        self._found_inf: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if self._guard is None:
            return super().step(closure)
        scale = self._guard.inspect(self._gradients())
        self._found_inf = (~torch.isfinite(self._guard.norm)).float()
        self.found_inf = self._found_inf  # read by torch's fused kernel
        self.grad_scale = None if scale is None else scale.reciprocal().float()  # the kernel's dtype
        try:
            return super().step(closure)
        finally:
            del self.found_inf, self.grad_scale

    @property
    def overflow(self) -> bool:
        """Whether the last guarded step was skipped (non-finite gradients): reads the device's flag."""
        return self._found_inf is not None and bool(self._found_inf)


def _steps_as_tensors(optimizer: AdamW, state_dict: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's FusedAdam keeps ``step`` as an int per tensor; the fused kernel wants a float tensor."""
    for state in state_dict["state"].values():
        if "step" in state and not torch.is_tensor(state["step"]):
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
    return state_dict
