"""The benchmarks run end to end on tiny inputs and report what docs/benchmarks.md shows. Their timings
are never asserted (only ratios measured on a real machine mean anything). The loss benchmark, which
starts its ranks, is tests/launched/test_bench_loss_ranks.py's."""

import json
from pathlib import Path

import pytest

from benchmarks.speed import format_report, run_speed_benchmark


def test_speed_benchmark_reports_all_contestants_and_phases(tmp_path):
    results = run_speed_benchmark(
        model="test-vit-xs",
        batch_size=4,
        steps=2,
        warmup=1,
        output=tmp_path / "speed.json",
        progress=False,
        peak_tflops=0.001,  # no GPU here: the table has no peak for a CPU
        precision="fp32",
        trace_dir=tmp_path / "traces",
    )
    assert (tmp_path / "speed.json").is_file()
    names = ["ours mask=0", "openclip mask=0", "ours mask=0.5", "openclip mask=0.5"]
    assert list(results["contestants"]) == names
    assert (
        results["config"]["precision"] == "fp32" and "+ torch.autocast" not in results["config"]["openclip"]
    )
    gflop = results["config"]["gflop_per_sample"]  # the training log's count, one per masking
    assert list(gflop) == ["0", "0.5"] and gflop["0"] > gflop["0.5"] > 0
    assert results["config"]["peak_tflops"] == 0.001
    for name, r in results["contestants"].items():
        assert len(r["step_times_s"]) == 2 and len(r["losses"]) == 3
        phases = r["phases_median_s"]
        assert set(phases) == {"forward", "backward", "after_backward"}
        assert sum(phases.values()) <= r["median_s"] * 1.5
        assert r["after_backward_share"] == pytest.approx(phases["after_backward"] / r["median_s"])
        assert r["gflop_per_sample"] == gflop[name.rpartition("=")[2]]  # ours and OpenCLIP's alike
        assert r["tflops"] == pytest.approx(r["samples_per_s"] * r["gflop_per_sample"] / 1e3)
        assert r["mfu"] == pytest.approx(r["tflops"] / 0.001)
        compute = phases["forward"] + phases["backward"]  # without the step after the backward
        assert r["compute_mfu"] == pytest.approx(r["mfu"] * r["median_s"] / compute)
        trace = json.loads(Path(r["trace"]).read_text())  # chrome://tracing's format
        assert trace["traceEvents"]
    ratios = results["ratios"]
    for m in ("mask0", "mask0.5"):
        ours, oc = (
            results["contestants"][f"ours {m[:4]}={m[4:]}"],
            results["contestants"][f"openclip {m[:4]}={m[4:]}"],
        )
        after = oc["phases_median_s"]["after_backward"] / ours["phases_median_s"]["after_backward"]
        assert ratios[f"after_backward_ours_over_openclip_{m}"] == pytest.approx(after)
        assert ratios[f"ours_over_openclip_{m}"] == pytest.approx(oc["median_s"] / ours["median_s"])
        paired = sorted(c / o for o, c in zip(ours["step_times_s"], oc["step_times_s"]))
        assert ratios[f"paired_ours_over_openclip_{m}"] == pytest.approx(sum(paired) / 2)  # two rounds
    report = format_report(results)
    assert "masking speed-up: ours" in report and "after the backward" in report and "share" in report
    assert "MFU" in report and "GFLOP per training sample, both sides: mask 0: " in report


def test_speed_benchmark_precision_follows_the_hardware(monkeypatch):
    """``--precision auto``: bf16 where the device computes it natively, else fp32 (never emulated bf16)."""
    from benchmarks import step_contestants
    from eva_fastclip.plan import precision

    for native, expected in ((True, "bf16"), (False, "fp32")):
        hardware = precision.Hardware(cuda=False, native_bf16=native, description="a test CPU")
        monkeypatch.setattr(precision, "detect_hardware", lambda hardware=hardware: hardware)
        assert step_contestants.native_precision() == expected


def test_lamb_benchmark_times_both_trust_ratio_rules(tmp_path):
    from benchmarks.lamb_step import flat_groups, format_lamb_report, run_lamb_benchmark, vit_tensors

    tensors = vit_tensors(width=32, layers=2)
    groups = flat_groups(tensors)
    assert len(groups) == 2 * 4  # (embeddings, 2 blocks, head) x (decay, no decay)
    assert sorted(f.tensor for g in groups for f in g["fragments"]) == list(range(len(tensors)))
    results = run_lamb_benchmark(width=32, layers=2, rounds=2, device="cpu", output=tmp_path / "lamb.json")
    assert (tmp_path / "lamb.json").is_file()
    assert list(results["contestants"]) == ["per_zero_partition", "per_tensor"]  # FusedLamb: CUDA only
    assert all(len(r["step_times_s"]) == 2 for r in results["contestants"].values())
    assert results["params"] == sum(g["size"] for g in groups)
    assert "per_tensor" in format_lamb_report(results)
    # ZeRO-0: the model's tensors, each walk of our LAMB on a CPU against OpenCLIP's AdamW
    zero0 = run_lamb_benchmark(width=32, layers=2, rounds=1, device="cpu", layout="zero0")
    assert list(zero0["contestants"]) == ["lamb_fused_cpu", "lamb_sweep", "openclip_adamw", "adamw_fused"]
    assert zero0["baseline"] == "openclip_adamw" and zero0["params"] == results["params"] - sum(
        g["size"] - sum(f.length for f in g["fragments"]) for g in groups
    )  # the same tensors, without the flat groups' padding


def test_accumulation_benchmark_runs_every_side_on_the_same_batch(tmp_path):
    """python -m benchmarks.accumulation: ours in one micro-batch, micro and global accumulation, and
    OpenCLIP's own accum_freq step, masks 0 and 0.5; step times, losses and peaks recorded, the ratios
    formed."""
    import math

    from benchmarks.accumulation import SIDES, format_accumulation_report, run_accumulation_benchmark

    results = run_accumulation_benchmark(
        model="test-vit-xs",
        global_batch=8,
        accum=2,
        steps=2,
        warmup=1,
        output=tmp_path / "a.json",
        progress=False,
    )
    assert (tmp_path / "a.json").is_file()
    assert list(results["contestants"]) == [f"{side} mask={m:g}" for m in (0.0, 0.5) for side in SIDES]
    for name, r in results["contestants"].items():
        assert len(r["step_times_s"]) == 2 and len(r["losses"]) == 3 and r["peak_bytes"] > 0
        assert all(math.isfinite(loss) for loss in r["losses"]), name
        assert (r["deepspeed_bucket_bytes"] > 0) == name.startswith("ours")
    assert len(results["ratios"]) == 12
    report = format_accumulation_report(results)
    assert "openclip accum" in report and "w/o DS bucket" in report


def test_benchmark_commands_refuse_bad_values_before_any_work(capsys):
    """Each benchmark is its own command (``python -m benchmarks.NAME``): a bad value is told as argparse
    tells a bad option, exit status 2."""
    from benchmarks import accumulation, lamb_step, speed

    assert speed.main(["--steps", "0"]) == 2
    assert "python -m benchmarks.speed: error: benchmarks.speed needs --steps >= 1" in capsys.readouterr().err
    assert accumulation.main(["--batch-size", "6", "--accumulate", "4"]) == 2
    assert "needs --accumulate >= 2 dividing --batch-size (6)" in capsys.readouterr().err
    assert lamb_step.build_parser().parse_args([]).rounds == 7
