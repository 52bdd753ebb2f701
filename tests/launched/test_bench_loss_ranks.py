"""``python -m benchmarks.loss_memory`` on tiny sizes, its ranks spawned on 1 and 2 processes: the exact
byte counts of docs/benchmarks.md (its timings are never asserted)."""

from benchmarks.loss_memory import expected_traffic, format_table, run_benchmark


def test_loss_benchmark_counts_the_documented_bytes_and_no_backward_traffic():
    results = run_benchmark(ks=(1, 2), sizes=(32, 64), dim=16)
    claims = results["analysis"]["claims"]
    assert claims["traffic_matches_formulas"]["holds"], claims["traffic_matches_formulas"]
    assert claims["ours_no_backward_traffic"]["holds"]
    point = next(p for p in results["points"] if p["K"] == 2 and p["B"] == 64)
    # OpenCLIP's gather-with-grad sends the B x d feature gradients back; ours sends none
    assert point["openclip"]["bytes_backward"] == expected_traffic(64, 2, 16)["openclip"]["backward"] > 0
    assert point["ours"]["bytes_backward"] == 0
    assert "claim ours_no_backward_traffic: holds" in format_table(results)
