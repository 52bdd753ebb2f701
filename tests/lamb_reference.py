"""DeepSpeed's FusedLamb update of one tensor, rewritten in float64 from csrc/lamb/fused_lamb_cuda_kernel.cu:
the reference that tests/test_lamb.py and tests/test_lamb_zero.py hold our LAMB to."""

import math
from pathlib import Path

import torch

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
