"""SigLIP on 2 real gloo ranks, float64 (a piece of the session's 2-rank suite): each rank's loss and
gradients (its features, log t, b) equal those open_clip's ``SigLipLoss`` computes on that rank under each
of its ``dist_impl``, the ranks' mean is the paper's formula over the whole batch (tests/siglip_reference.py),
and our loss sends nothing but the all-gather of the features (open_clip's sends the texts' gradients back).
"""

import pytest
import torch
import torch.distributed as dist
from open_clip.loss import SigLipLoss as OpenClipSigLipLoss
from siglip_reference import B, D, pairs

from eva_fastclip.losses import Gatherer, SigLipLoss

TWO_RANK_PIECES = ("siglip",)
WORLD = 2
DIST_IMPLS = ("bidir", "shift", "reduce", "gather")
BIASES = (-10.0, -1.0)  # SigLIP's init (negatives ~e^-10) and one where the negatives weigh in


def on_this_rank(leaves, rank, contestant):
    """``contestant(x, y, t, b)`` on this rank's rows: its value and gradients (x, y, log t, b)."""
    images, texts, log_t, b = leaves
    own = slice(rank * (B // WORLD), (rank + 1) * (B // WORLD))
    x, y = images[own].clone().requires_grad_(True), texts[own].clone().requires_grad_(True)
    log_t, b = log_t.clone().requires_grad_(True), b.clone().requires_grad_(True)
    value, loss = contestant(x, y, log_t.exp(), b)
    return value, torch.autograd.grad(loss, (x, y, log_t, b))


def two_ranks(out):
    """Every rank: ours and open_clip's (each dist_impl) at each bias; saved to OUT/rank<K>.pt."""
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD
    results = {}
    for bias in BIASES:
        leaves, _, _ = pairs(seed=4, bias=bias)
        gatherer = Gatherer(rank, WORLD)

        def ours(x, y, t, b, gatherer=gatherer):
            output = SigLipLoss(gatherer)(x, y, t, torch.arange(B), logit_bias=b)
            return output.metrics["loss/contrastive"], output.loss

        results[bias, "ours"] = (*on_this_rank(leaves, rank, ours), dict(gatherer.traffic))
        for impl in DIST_IMPLS:
            theirs = OpenClipSigLipLoss(rank=rank, world_size=WORLD, dist_impl=impl)

            def open_clip(x, y, t, b, theirs=theirs):
                loss = theirs(x, y, t, b)
                return loss.item(), loss

            results[bias, impl] = on_this_rank(leaves, rank, open_clip)
    torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()


@pytest.fixture(scope="module")
def ranks(two_rank_suite):
    out = two_rank_suite("siglip")
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("bias", BIASES)
@pytest.mark.parametrize("impl", DIST_IMPLS)
def test_each_rank_computes_what_open_clips_siglip_loss_computes_there(ranks, impl, bias):
    for rank, results in enumerate(ranks):
        value, grads, _ = results[bias, "ours"]
        their_value, their_grads = results[bias, impl]
        assert value == pytest.approx(their_value, rel=1e-12), f"rank {rank}"
        for name, got, want in zip(("images", "texts", "log t", "b"), grads, their_grads):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"rank {rank}: {name}")


@pytest.mark.parametrize("bias", BIASES)
def test_the_mean_over_ranks_is_the_papers_loss_and_only_features_are_sent(ranks, bias):
    """The engine's mean of the ranks' gradients (own features: K times their share) is the gradient of
    the paper's loss over all B pairs; each rank all-gathered 2·b·d float64 features and nothing else."""
    _, want_loss, want_grads = pairs(seed=4, bias=bias)
    b = B // WORLD
    for i in range(2):  # the features: each rank holds its rows'
        got = torch.cat([ranks[r][bias, "ours"][1][i] for r in range(WORLD)]) / WORLD
        torch.testing.assert_close(got, want_grads[i], rtol=1e-10, atol=1e-12)
    for i in (2, 3):  # log t and b: the mean
        got = sum(ranks[r][bias, "ours"][1][i] for r in range(WORLD)) / WORLD
        torch.testing.assert_close(got, want_grads[i], rtol=1e-10, atol=1e-12)
    assert sum(ranks[r][bias, "ours"][0] for r in range(WORLD)) / WORLD == pytest.approx(want_loss, rel=1e-12)
    for rank in ranks:
        assert rank[bias, "ours"][2] == {"features": 2 * b * D * 8}
