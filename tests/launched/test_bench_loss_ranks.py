"""``python -m benchmarks.loss_memory`` on tiny sizes, on 1 rank (in this process) and 2 ranks (a piece of the
session's 2-rank suite, tests/launched/two_rank_suite.py, in place of the benchmark's own spawn): the exact
byte counts of docs/benchmarks.md (its timings are never asserted)."""

import json

import torch.distributed as dist

from benchmarks.loss_memory import expected_traffic, format_table, measure_rank, run_benchmark, run_ranks

TWO_RANK_PIECES = ("loss_benchmark",)
SIZES, DIM = (32, 64), 16


def two_ranks(out):
    """Every rank of the 2-rank suite: its results at every B, as the benchmark's spawned ranks write them."""
    rank = dist.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(measure_rank(rank, 2, list(SIZES), DIM)))


def test_loss_benchmark_counts_the_documented_bytes_and_no_backward_traffic(two_rank_suite):
    def ranks(world, sizes, dim):
        if world == 1:
            return run_ranks(world, sizes, dim)
        assert (world, tuple(sizes), dim) == (2, SIZES, DIM)
        folder = two_rank_suite("loss_benchmark")
        return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(world)]

    results = run_benchmark(ks=(1, 2), sizes=SIZES, dim=DIM, ranks=ranks)
    claims = results["analysis"]["claims"]
    assert claims["traffic_matches_formulas"]["holds"], claims["traffic_matches_formulas"]
    assert claims["ours_no_backward_traffic"]["holds"]
    point = next(p for p in results["points"] if p["K"] == 2 and p["B"] == 64)
    # OpenCLIP's gather-with-grad sends the B x d feature gradients back; ours sends none
    assert point["openclip"]["bytes_backward"] == expected_traffic(64, 2, 16)["openclip"]["backward"] > 0
    assert point["ours"]["bytes_backward"] == 0
    assert "claim ours_no_backward_traffic: holds" in format_table(results)
