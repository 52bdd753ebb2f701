"""``python -m benchmarks.loss_memory`` on tiny sizes, on 1 rank (in this process) and 2 ranks (a piece of the
session's 2-rank suite, tests/launched/two_rank_suite.py, in place of the benchmark's own spawn): the exact
byte counts of docs/benchmarks.md (its timings are never asserted)."""

import json

import torch.distributed as dist

from benchmarks.loss_memory import (
    LOSSES,
    expected_traffic,
    format_table,
    measure_rank,
    run_benchmark,
    run_ranks,
)

TWO_RANK_PIECES = ("loss_benchmark",)
SIZES, DIM = (32, 64), 16


def two_ranks(out):
    """Every rank of the 2-rank suite: its results at every B for each loss, as the benchmark's spawned ranks
    write them."""
    rank = dist.get_rank()
    for loss in LOSSES:
        results = measure_rank(rank, 2, list(SIZES), DIM, loss)
        (out / f"{loss}_rank{rank}.json").write_text(json.dumps(results))


def benchmark(two_rank_suite, loss):
    def ranks(world, sizes, dim, loss):
        if world == 1:
            return run_ranks(world, sizes, dim, loss)
        assert (world, tuple(sizes), dim) == (2, SIZES, DIM)
        folder = two_rank_suite("loss_benchmark")
        return [json.loads((folder / f"{loss}_rank{rank}.json").read_text()) for rank in range(world)]

    return run_benchmark(ks=(1, 2), sizes=SIZES, dim=DIM, ranks=ranks, loss=loss)


def test_loss_benchmark_counts_the_documented_bytes_and_no_backward_traffic(two_rank_suite):
    results = benchmark(two_rank_suite, "fastclip_v3")
    claims = results["analysis"]["claims"]
    assert claims["traffic_matches_formulas"]["holds"], claims["traffic_matches_formulas"]
    assert claims["ours_no_backward_traffic"]["holds"]
    point = next(p for p in results["points"] if p["K"] == 2 and p["B"] == 64)
    # OpenCLIP's gather-with-grad sends the B x d feature gradients back; ours sends none
    assert point["openclip"]["bytes_backward"] == expected_traffic(64, 2, 16)["openclip"]["backward"] > 0
    assert point["ours"]["bytes_backward"] == 0
    assert "claim ours_no_backward_traffic: holds" in format_table(results)


def test_siglip_beside_open_clips_siglip_loss_sends_features_only(two_rank_suite):
    """open_clip's bidir SigLipLoss passes its texts to the other rank and gets their gradients back; ours
    all-gathers both features and sends nothing in the backward. Every contestant's gradients are finite."""
    results = benchmark(two_rank_suite, "siglip")
    claims = results["analysis"]["claims"]
    assert claims["traffic_matches_formulas"]["holds"], claims["traffic_matches_formulas"]
    assert claims["ours_no_backward_traffic"]["holds"]
    point = next(p for p in results["points"] if p["K"] == 2 and p["B"] == 64)
    assert point["openclip"]["bytes_backward"] == 32 * DIM * 4 > 0  # b x d float32 text gradients
    assert point["ours"]["gatherer_traffic"] == {"features": 2 * 32 * DIM * 4}
    assert all(p[name]["grads_finite"] for p in results["points"] for name in ("ours", "openclip"))
    assert "siglip loss step" in format_table(results)
