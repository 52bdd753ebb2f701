"""DeepSpeed's FusedLamb written in PyTorch ops: what ``"type": "Lamb"`` steps with where CUDA is absent.

On CUDA the optimizer is DeepSpeed's ``FusedLamb`` (ops/csrc/lamb/fused_lamb_cuda_kernel.cu); this class
computes the same update on any device, so an experiment takes the same steps on CPU and GPU. Per tensor
(under ZeRO-1 that is per flat partition of a parameter group), with ``t`` the tensor's own step count:

    m <- beta1 m + (1 - beta1) g
    v <- beta2 v + (1 - beta2) g^2
    u  = m / (sqrt(v) + eps) + weight_decay w          (eps_inside_sqrt: m / sqrt(v + eps))
    r  = ||w|| / ||u||, clipped to at most max_coeff, then to at least min_coeff; r = 1 if ||w|| or ||u|| is 0
    w <- w - lr r u sqrt(1 - beta2^t) / (1 - beta1^t)     (without bias_correction: w - lr r u)

Where this differs from timm's ``Lamb`` and FastCLIP's LAMB: every tensor gets the trust ratio, biases,
norms and the temperature included (theirs skip groups without weight decay) and it is always clipped;
eps is added to the square root of the uncorrected v; ``r`` is taken from the uncorrected moments and the
bias correction only scales the step; the weight decay is part of ``u``, so the trust ratio scales it too.
A group's ``max_coeff`` / ``min_coeff`` are read per group, as FusedLamb reads them: ``max_coeff =
min_coeff = 1`` steps that group like Adam with weight decay inside the update.

The state (``step``, ``exp_avg``, ``exp_avg_sq`` per tensor) and the group keys are FusedLamb's, so one
device's checkpoint resumes on the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class Lamb(torch.optim.Optimizer):
    """FusedLamb's update in PyTorch ops; same constructor arguments, same defaults.

    ``max_grad_norm`` must stay 0: FusedLamb clips only with gradient norms passed to its ``step``, which
    DeepSpeed never does (it clips by ``gradient_clipping`` before the step), so it would fail at once.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError("Lamb has no AMSGrad variant (nor has FusedLamb): set amsgrad=False")
        if max_grad_norm != 0.0:
            raise ValueError(
                f"Lamb max_grad_norm={max_grad_norm}: FusedLamb clips only with gradient norms passed to its "
                "step, which DeepSpeed never passes; clip with DeepSpeed's gradient_clipping and leave it 0"
            )
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"Lamb needs lr, eps and weight_decay >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"Lamb betas must lie in [0, 1), got {tuple(betas)}")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"Lamb needs 0 <= min_coeff <= max_coeff, got {min_coeff} and {max_coeff}")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.register_load_state_dict_pre_hook(_from_timm_lamb)
        self.eps_inside_sqrt = eps_inside_sqrt
        self.lamb_coeffs: list[float] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []  # FusedLamb keeps the last step's coefficients only
        for group in self.param_groups:
            if group["max_grad_norm"] > 0:
                raise ValueError(
                    f"a Lamb group has max_grad_norm={group['max_grad_norm']}; it must be 0 (see Lamb)"
                )
            for param in group["params"]:
                if param.grad is not None:
                    self.lamb_coeffs.append(self._step_tensor(param, group))
        return loss

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios of the last step, one per tensor stepped (FusedLamb's method)."""
        return list(self.lamb_coeffs)

    def _step_tensor(self, param: torch.Tensor, group: dict[str, Any]) -> float:
        grad = param.grad
        if grad.is_sparse:
            raise RuntimeError("Lamb does not support sparse gradients")
        grad = grad.to(param.dtype)  # FusedLamb takes half gradients for float weights too
        state = self.state[param]
        if not state:
            state.update(step=0, exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))
        elif "step" not in state:
            raise RuntimeError(
                f"Lamb state has keys {sorted(state)} but no per-tensor 'step': it was saved by an "
                "optimizer other than FusedLamb, this Lamb or timm's Lamb, and cannot be continued"
            )
        state["step"] += 1
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        if self.eps_inside_sqrt:
            update = exp_avg_sq.add(group["eps"]).sqrt_()
        else:
            update = exp_avg_sq.sqrt().add_(group["eps"])
        torch.div(exp_avg, update, out=update)
        if group["weight_decay"]:
            update.add_(param, alpha=group["weight_decay"])

        # clipped as the kernel does: to max_coeff first, then to min_coeff; a NaN ratio stays NaN
        weight_norm = torch.linalg.vector_norm(param).item()
        update_norm = torch.linalg.vector_norm(update).item()
        coeff = 1.0
        if weight_norm != 0.0 and update_norm != 0.0:
            coeff = weight_norm / update_norm
            if coeff > group["max_coeff"]:
                coeff = group["max_coeff"]
            if coeff < group["min_coeff"]:
                coeff = group["min_coeff"]

        step_size = group["lr"]
        if group["bias_correction"]:
            step = state["step"]
            step_size *= (1.0 - beta2**step) ** 0.5 / (1.0 - beta1**step)
        param.add_(update, alpha=-step_size * coeff)
        return coeff


#: Group keys of timm's Lamb (what eva_fastclip used on CPU before this class) that FusedLamb has not.
_TIMM_ONLY_GROUP_KEYS = (
    "step",
    "grad_averaging",
    "trust_clip",
    "always_adapt",
    "caution",
    "decoupled_decay",
    "corrected_weight_decay",
    "max_lr_snapshot",
    "foreach",
)


def _from_timm_lamb(optimizer: Lamb, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Continue a checkpoint whose CPU optimizer was timm's Lamb: its moments are the same running averages,
    but it keeps the step count per group, and ``max_grad_norm=None`` would stop the next step."""
    groups = []
    for group in state_dict["param_groups"]:
        group = dict(group)
        if "step" in group:  # timm's: carry its step count over to every tensor of the group
            step = int(group["step"])
            for param_id in group["params"]:
                if param_id in state_dict["state"]:
                    state_dict["state"][param_id] = {**state_dict["state"][param_id], "step": step}
            for key in _TIMM_ONLY_GROUP_KEYS:
                group.pop(key, None)
            if group.get("max_grad_norm") is None:
                group["max_grad_norm"] = 0.0
            for key in ("max_coeff", "min_coeff"):
                group.setdefault(key, optimizer.defaults[key])
        groups.append(group)
    return {**state_dict, "param_groups": groups}
