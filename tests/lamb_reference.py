"""DeepSpeed's FusedLamb update of one tensor, rewritten in float64 from csrc/lamb/fused_lamb_cuda_kernel.cu:
the reference that tests/test_lamb.py and tests/test_lamb_zero.py hold our LAMB to; and our Lamb as it
stepped before its multi-tensor passes, which they hold the new step to in float64."""

import math
from pathlib import Path

import torch
import torch.distributed as dist

from eva_fastclip.optim.lamb import Lamb
from eva_fastclip.optim.lamb_passes import pieces

LAMB_JSON = Path(__file__).parents[1] / "ds_configs" / "zero1_fp32_lamb.json"
BETAS, EPS = (0.9, 0.98), 1e-6


def kernel_step(w, g, m, v, step, *, lr, weight_decay, betas=BETAS, eps=EPS, max_coeff=10.0, min_coeff=0.01,
                bias_correction=True, eps_inside_sqrt=False):  # fmt: skip
    """One FusedLamb update of one tensor in float64: lamb_cuda_kernel_part1..3 and fused_lamb_cuda.

    part1: m, v from the gradient; u = m / denom + decay * w; sums of w^2 and u^2 (w before the update).
    part3: lamb_coeff = ||w|| / ||u|| clipped (max first, then min), 1 when either norm is 0;
    w -= step_size * lamb_coeff * u, step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t) with bias correction.
    Returns (w, m, v, lamb_coeff).
    """
    w, g, m, v = (x.detach().double() for x in (w, g, m, v))
    beta1, beta2 = betas
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = torch.sqrt(v + eps) if eps_inside_sqrt else torch.sqrt(v) + eps
    u = m / denom + weight_decay * w
    reg_w, reg_u = math.sqrt((w * w).sum().item()), math.sqrt((u * u).sum().item())
    coeff = 1.0
    if reg_w != 0 and reg_u != 0:
        coeff = reg_w / reg_u
        if coeff > max_coeff:
            coeff = max_coeff
        if coeff < min_coeff:
            coeff = min_coeff
    step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step) if bias_correction else lr
    return w - step_size * coeff * u, m, v, coeff


# ---- eva_fastclip's Lamb before its multi-tensor step ----------------------------------------------------


class TodaysLamb(Lamb):
    """``eva_fastclip.optim.lamb.Lamb`` as it stepped before its multi-tensor passes (until 2026-11-29):
    one parameter and one fragment at a time, the ratios read back as Python floats. The reference the
    multi-tensor step is held to in float64 (tests/lamb_zero_runs.py's replays)."""

    def _step_fragments(self, items, num_tensors, reduce_over=None, grad_scale=None):
        assert grad_scale is None, "today's step took clipped gradients from DeepSpeed"
        device = items[0][0].device
        sums = torch.zeros(2, num_tensors, dtype=torch.float64, device=device)
        high = torch.full((num_tensors,), float("inf"), dtype=torch.float64, device=device)
        low = torch.zeros(num_tensors, dtype=torch.float64, device=device)
        updates = []
        for param, group, frags in items:
            update = self._todays_update(param, group)
            updates.append(update)
            if not frags:
                continue
            weights, parts = pieces(param, frags), pieces(update, frags)
            norms = torch.stack(torch._foreach_norm(weights + parts)).double().square_()
            index = torch.tensor([f.tensor for f in frags], device=device)
            sums.index_add_(1, index, norms.view(2, len(frags)))
            high.index_fill_(0, index, group["max_coeff"])
            low.index_fill_(0, index, group["min_coeff"])
        if reduce_over is not None:
            dist.all_reduce(sums, group=reduce_over)
        weight_norm, update_norm = sums.sqrt_().unbind(0)
        ratio = weight_norm / update_norm
        ratio = torch.where(ratio > high, high, ratio)
        ratio = torch.where(ratio < low, low, ratio)
        ratio = torch.where((weight_norm != 0) & (update_norm != 0), ratio, torch.ones_like(ratio))
        ratios = ratio.tolist()
        for (param, group, frags), update in zip(items, updates):
            step_size = group["lr"]
            if group["bias_correction"]:
                beta1, beta2 = group["betas"]
                step = self.state[param]["step"]
                step_size *= (1.0 - beta2**step) ** 0.5 / (1.0 - beta1**step)
            for weight, part, frag in zip(pieces(param, frags), pieces(update, frags), frags):
                weight.add_(part, alpha=-step_size * ratios[frag.tensor])

    def _todays_update(self, param, group):
        state = self._state_of(param)
        state["step"] += 1
        grad = param.grad.to(param.dtype)
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
        return update
