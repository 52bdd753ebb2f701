"""(b) 2 ranks with global batch B give the gradients and state updates of 1 rank with the same B;
(c) the bytes each rank passes to collectives match docs/losses.md, and none carry feature gradients;
(d) with tau_gradient=fastclip_code each rank's gradients are those of FastCLIP's own rank loss.

Real collectives: two ranks over gloo, a piece of the session's 2-rank suite (no DeepSpeed needed for the
loss itself).
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fastclip_reference import fastclip_v3_rank_loss

from eva_fastclip.losses import Gatherer, build_loss

TWO_RANK_PIECES = ("compositional",)

B, D, WORLD, RHO, TAU = 8, 6, 2, 6.5, 0.05
#: variant -> (loss name, LossConfig overrides)
NAMES = ("sogclr", "fastclip_v0", "fastclip_v1", "fastclip_v2", "fastclip_v3", "isogclr")
VARIANTS = {
    **{name: (name, {}) for name in NAMES},  # each loss's defaults: v3 with FastCLIP code's tau-gradient
    "fastclip_v3_code": ("fastclip_v3", {"tau_gradient": "fastclip_code"}),
    "fastclip_v3_exact": ("fastclip_v3", {"tau_gradient": "exact"}),
    "isogclr_momentum": ("isogclr", {"temperature_rule": "individual_momentum"}),
}


def batches():
    """Two steps over the same 8 samples, in a different order the second time (their state moves rank)."""
    g = torch.Generator().manual_seed(0)
    steps = []
    for order in (torch.arange(B), torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])):
        e1 = F.normalize(torch.randn(B, D, generator=g, dtype=torch.float64), dim=-1)
        e2 = F.normalize(torch.randn(B, D, generator=g, dtype=torch.float64), dim=-1)
        steps.append((e1, e2, order))
    return steps


def run_steps(variant, rank, world):
    """Two steps (epoch 0: gamma = 1, then epoch 1: gamma < 1) on this rank's slice of each batch."""
    gatherer = Gatherer(rank, world) if world > 1 else Gatherer()
    name, overrides = VARIANTS[variant]
    loss_fn = build_loss(name, gatherer=gatherer, dataset_size=B, rho=RHO, gamma_decay_epochs=2, **overrides)
    theta = torch.tensor([math.log(1 / TAU)], dtype=torch.float64, requires_grad=True)
    b = B // world
    local = slice(rank * b, (rank + 1) * b)
    results = []
    for epoch, (e1, e2, order) in enumerate(batches()):
        loss_fn.set_epoch(epoch)
        gatherer.traffic.clear()
        x1, x2 = e1[local].clone().requires_grad_(True), e2[local].clone().requires_grad_(True)
        out = loss_fn(x1, x2, theta.exp(), order[local])
        wrt = (x1, x2, theta) if loss_fn.temperature.learns_global else (x1, x2)
        grads = torch.autograd.grad(out.loss, wrt)
        loss_fn.on_step_applied()
        owned = torch.arange(loss_fn.state.lo, loss_fn.state.hi)
        results.append(
            {
                "grads": grads,
                "rows": (owned, loss_fn.state.local_rows(owned).clone()),
                "traffic": dict(gatherer.traffic),
                "fields": len(loss_fn.state.fields),
            }
        )
    return results


def two_ranks(out):
    """Every rank of the 2-rank suite (tests/launched/two_rank_suite.py): each variant's two steps."""
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD
    results = {variant: run_steps(variant, rank, WORLD) for variant in VARIANTS}
    torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()


@pytest.fixture(scope="module")
def distributed(two_rank_suite):
    out_dir = two_rank_suite("compositional")
    per_rank = [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]
    return {variant: [results[variant] for results in per_rank] for variant in VARIANTS}


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_ranks_match_one(distributed, variant):
    single = run_steps(variant, 0, 1)
    ranks = distributed[variant]
    b = B // WORLD
    for step in range(2):
        one = single[step]["grads"]
        # the engine averages parameter gradients over ranks: rank k's own features get 1/K of its gradient
        for r in range(WORLD):
            for got, want in zip(ranks[r][step]["grads"][:2], one[:2]):
                torch.testing.assert_close(got / WORLD, want[r * b : (r + 1) * b], rtol=1e-9, atol=1e-12)
        if len(one) == 3:  # the global temperature: the ranks' average
            average = sum(ranks[r][step]["grads"][2] for r in range(WORLD)) / WORLD
            torch.testing.assert_close(average, one[2], rtol=1e-9, atol=1e-12)
        # the per-sample tables, split by index range over the ranks, equal the single-rank table
        table = torch.cat([ranks[r][step]["rows"][1] for r in range(WORLD)])
        owned = torch.cat([ranks[r][step]["rows"][0] for r in range(WORLD)])
        assert owned.tolist() == list(range(B))
        torch.testing.assert_close(table, single[step]["rows"][1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_collective_bytes_match_the_formula(distributed, variant):
    """docs/losses.md: per step and rank, with b local pairs, B = K·b, d dims, F state fields, s bytes per
    feature element: features 2·b·d·s, indices 8·b, state lookup 4·B·F, state update b·F·s."""
    b, s = B // WORLD, 8  # float64 features in this test
    for rank in distributed[variant]:
        for step in rank:
            fields = step["fields"]
            expected = {
                "features": 2 * b * D * s,
                "indices": 8 * b,
                "state_lookup": 4 * B * fields,
                "state_update": b * fields * s,
            }
            assert step["traffic"] == expected  # nothing else: no feature gradients cross ranks


def test_fastclip_code_per_rank(distributed):
    """Before the engine averages them, each rank's gradients (features and theta) are those of the loss
    FastCLIP's code back-propagates on that rank (step 1: gamma = 1, so u = g; fastclip_reference.py)."""
    e1, e2, order = batches()[0]
    assert order.tolist() == list(range(B))  # dataset index = position in the global batch
    b = B // WORLD
    for r in range(WORLD):
        x1, x2 = e1.clone().requires_grad_(True), e2.clone().requires_grad_(True)
        theta = torch.tensor([math.log(1 / TAU)], dtype=torch.float64, requires_grad=True)
        reference = fastclip_v3_rank_loss(x1, x2, theta.exp(), rank=r, world=WORLD, rho=RHO, eps=1e-14)
        want1, want2, want_theta = torch.autograd.grad(reference, (x1, x2, theta))
        got1, got2, got_theta = distributed["fastclip_v3_code"][r][0]["grads"]
        own = slice(r * b, (r + 1) * b)
        torch.testing.assert_close(got1, want1[own], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(got2, want2[own], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(got_theta, want_theta, rtol=1e-9, atol=1e-12)
