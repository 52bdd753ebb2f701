"""The clip and the non-finite guard inside our optimizers' steps (optim/step_guard.py), which take over from
DeepSpeed at ZeRO-0, held to the computation they replace, in float64: ``torch.nn.utils.clip_grad_norm_``
(DeepSpeed's and torch's coefficient) followed by the unguarded step (1e-12 of each tensor's norm; AdamW's
kernel takes the coefficient in float32: 1e-7). A non-finite gradient leaves every
weight, moment and step count as it was. The run-level skip: tests/test_nonfinite.py (zero0-skipped)."""

import copy

import pytest
import torch
from torch import nn

from eva_fastclip.optim.adamw import AdamW
from eva_fastclip.optim.lamb import Lamb

MAX_NORM = 0.5


def tensors(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 8), (8,), (300,), (1,), (80, 64)]  # the last compiled in LAMB's fused walk
    return [nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64)) for s in shapes]


def gradients(step: int, params) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [
        torch.randn(p.shape, generator=g, dtype=torch.float64) * (3.0 if step % 2 else 0.01) for p in params
    ]


def make(kind: str, params, walk: str = "auto"):
    groups = [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]
    if kind == "lamb":
        optimizer = Lamb(groups, lr=1e-2, betas=(0.9, 0.98), eps=1e-6)
        optimizer.cpu_walk = walk
        return optimizer
    return AdamW(groups, lr=1e-2, betas=(0.9, 0.98), eps=1e-6)


@pytest.mark.parametrize("kind", ["lamb-sweep", "lamb-fused", "lamb-multi", "adamw"])
def test_the_guarded_step_is_clip_grad_norm_then_the_step(kind):
    """4 steps, the odd ones' gradients above the clip (clipped), the even ones' below (untouched)."""
    guarded, plain = tensors(), tensors()
    name, walk = (kind.split("-") + ["auto"])[:2]
    # of each tensor's norm: LAMB applies the coefficient in float64; torch's fused AdamW kernel takes it as
    # a float32 grad_scale (1 / coefficient), rounded to 1e-8 of itself
    tolerance = 1e-12 if name == "lamb" else 1e-7
    ours, reference = make(name, guarded, walk), make(name, plain, walk)
    ours.guard_gradients(MAX_NORM)
    for step in range(1, 5):
        for p, g in zip(guarded, gradients(step, guarded)):
            p.grad = g.clone()
        for p, g in zip(plain, gradients(step, plain)):
            p.grad = g.clone()
        norm = torch.nn.utils.clip_grad_norm_(plain, MAX_NORM)  # the coefficient DeepSpeed's clip uses
        reference.step()
        ours.step()
        assert not ours.overflow
        assert ours._global_grad_norm.item() == pytest.approx(norm.item(), rel=1e-6)  # float32 sums
        for a, b in zip(guarded, plain):
            pairs = [(a, b)] + [(ours.state[a][k], reference.state[b][k]) for k in ("exp_avg", "exp_avg_sq")]
            for x, y in pairs:
                assert ((x - y).norm() / y.norm()).item() <= tolerance, (kind, step)


@pytest.mark.parametrize("kind", ["lamb", "adamw"])
def test_a_non_finite_gradient_skips_the_whole_step(kind):
    params = tensors()
    optimizer = make(kind, params)
    optimizer.guard_gradients(MAX_NORM)
    for p, g in zip(params, gradients(1, params)):
        p.grad = g
    optimizer.step()
    before = [p.detach().clone() for p in params]
    state = {
        id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
        for p in params
    }
    for p, g in zip(params, gradients(2, params)):
        p.grad = g
    params[2].grad[7] = float("nan")  # one element of one tensor
    optimizer.step()
    assert optimizer.overflow and not torch.isfinite(optimizer._global_grad_norm)
    for p, b in zip(params, before):
        assert torch.equal(p, b)
        for key, value in state[id(p)].items():
            assert torch.equal(torch.as_tensor(optimizer.state[p][key]), torch.as_tensor(value)), key
    for p, g in zip(params, gradients(3, params)):  # the next finite step is taken
        p.grad = g
    optimizer.step()
    assert not optimizer.overflow and not torch.equal(params[0], before[0])


def test_adamw_resumes_deepspeed_fused_adams_state():
    """FusedAdam (DeepSpeed's, CUDA runs before this AdamW) keeps an int step per tensor; the fused kernel a
    tensor: its checkpoint loads, and the next step is the one the loaded moments and count give."""
    params, again = tensors(), tensors()
    ours = make("adamw", params)
    for step in (1, 2):
        for p, g in zip(params, gradients(step, params)):
            p.grad = g
        ours.step()
    saved = copy.deepcopy(ours.state_dict())  # (its state dicts are the optimizer's own)
    for state in saved["state"].values():
        state["step"] = int(state["step"].item())  # as FusedAdam saved it
    with torch.no_grad():
        for a, p in zip(again, params):
            a.copy_(p)
    resumed = make("adamw", again)
    resumed.load_state_dict(saved)
    for group in (params, again):
        for p, g in zip(group, gradients(3, group)):
            p.grad = g
    ours.step()
    resumed.step()
    for a, b in zip(again, params):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
