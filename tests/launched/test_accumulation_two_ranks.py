"""Which layouts of the same global batch take the same step (tests/test_accumulation.py has the rest):
2 ranks x 4 pairs x 2 micro-batches (a piece of the session's 2-rank suite) against 1 rank x 8 x 2."""

import accumulation_ranks as layouts
import pytest
import torch

TWO_RANK_PIECES = ("accumulation",)


@pytest.fixture(scope="module")
def two_ranks(two_rank_suite):
    """2 ranks x 4 pairs x 2 micro-batches, each loss of accumulation_ranks.LOSSES: every rank's state."""
    out = two_rank_suite("accumulation")
    return {name: [torch.load(out / f"{name}_rank{r}.pt") for r in range(2)] for name in layouts.LOSSES}


def whole_table(ranks: list[dict]) -> torch.Tensor:
    """The per-sample table of every index, from the ranks' index ranges."""
    ranks = sorted(ranks, key=lambda r: r["lo"])
    return torch.cat([r["table"] for r in ranks])


@pytest.mark.parametrize("loss", layouts.LOSSES)
def test_two_ranks_take_the_step_of_one_rank_with_the_same_contrastive_batch(two_ranks, loss, tmp_path):
    """2 ranks x micro-batch 4 x 2 and 1 rank x micro-batch 8 x 2, the same pairs in each loss evaluation:
    the same weights, temperature and per-sample state after two steps (the second reads the first's u and
    tau_i, with gamma < 1). The 2-rank weights are the same on both ranks (one optimizer step of the average
    gradient)."""
    ranks = two_ranks[loss]
    # the reference on as many threads as a rank had (the cores split between the ranks): the same summation
    # order in the matrix products, whether pytest runs alone (every core) or as a worker of make test (one)
    before = torch.get_num_threads()
    torch.set_num_threads(ranks[0]["threads"])
    try:
        one = layouts.run(layouts.make_trainer(tmp_path, loss, layouts.POOL), layouts.step_pairs())
    finally:
        torch.set_num_threads(before)
    layouts.assert_same_step(ranks[0], one, table=whole_table(ranks))
    layouts.assert_same_step(ranks[1], one, table=whole_table(ranks))
