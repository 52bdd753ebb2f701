"""Training-step speed: our DeepSpeed step against OpenCLIP's own step, with and without 50% masking.

    python -m benchmarks.speed [--model ViT-B-16] [--batch-size 8] [--steps 9] [--warmup 2]
                               [--precision auto|bf16|fp32] [--compile] [--trace-dir DIR]

The contestants (benchmarks/step_contestants.py), (ours, openclip) x (patch dropout 0.0, 0.5), and with
``--compile`` the same four compiled (ours: ``train.compile``; OpenCLIP: ``--torchcompile`` with its step
strategy), share one process, one architecture, one batch size and one precision: ``auto`` is bf16 where
the device computes it natively and fp32 elsewhere, so a CPU without native bf16 compares both sides in
fp32 instead of timing emulated bf16. Each is warmed up, then the timed steps are interleaved round-robin
(one step of each contestant per round, the starting contestant rotating), so a slow phase of the machine
hits all alike. Reported: the median step time of each, samples/s, its phases (forward, backward, and
everything after the backward, in seconds and as a share of the step), and the ratios: ours over OpenCLIP
at equal masking (of the medians, and paired: the median over rounds of the two steps' ratio within a
round, which a slow phase of the machine cannot tilt), compiled against eager, each side's speed-up from
masking, and OpenCLIP's step after the backward over ours. On CPU only the ratios mean anything. Both
sides' TFLOP/s and MFU use one FLOP count per masking, the training log's (eva_fastclip/models/flops.py)
and its peak table (eva_fastclip/engine/throughput.py); ``--peak-tflops`` gives the peak elsewhere.
``--trace-dir`` writes a ``torch.profiler`` trace of one more step of each contestant (chrome://tracing,
Perfetto).

- **ours**: ``Trainer.train_step`` — the DeepSpeed engine of ``--deepspeed-config`` (default: ZeRO-0 with
  LAMB, bf16 by autocast over fp32 weights: ``ds_configs/zero0_lamb.json``), our loss in fp32,
  ``engine.backward``, ``engine.step``, hooks.
- **openclip**: the step of open_clip's trainer (``open_clip_train/train.py``) with its defaults: an fp32
  model under ``torch.autocast(bfloat16)`` (fp32: none) for forward and ``ClipLoss``, ``loss.backward()``,
  ``torch.optim.AdamW`` over open_clip's parameter groups, ``zero_grad``, logit_scale clamped to [0, ln 100].
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks.command_line import run_main
from benchmarks.step_contestants import (
    OPENCLIP_BETAS,
    OPENCLIP_EPS,
    OPENCLIP_LR,
    OPENCLIP_WD,
    OpenClipStep,
    OursStep,
    image_size,
    native_precision,
    synthetic_batch,
)
from eva_fastclip.plan.precision import cpu_model

MASKS = (0.0, 0.5)
DEFAULT_DS_CONFIG = "ds_configs/zero0_lamb.json"
PHASES = ("forward", "backward", "after_backward")


# ---- the run ------------------------------------------------------------------------------------------


def time_interleaved(
    contestants: dict[str, Any], batch, warmup: int, rounds: int, threads: int, progress: bool = True
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, dict[str, list[float]]]]:
    """Warm every contestant up, then time ``rounds`` rounds of one ``step(*batch)`` each, the first one
    rotating, so a slow phase of the machine hits all alike; per contestant its step times, losses and
    phase times (where it reports ``phases``)."""
    from tqdm import tqdm

    # the Trainer sets the thread count from LOCAL_WORLD_SIZE: make sure every contestant runs with ours
    torch.set_num_threads(threads)
    order = list(contestants)
    losses: dict[str, list[float]] = {name: [] for name in order}
    for name, contestant in contestants.items():
        for _ in range(warmup):
            losses[name].append(contestant.step(*batch))
    times: dict[str, list[float]] = {name: [] for name in order}
    phases: dict[str, dict[str, list[float]]] = {name: {} for name in order}
    for r in tqdm(range(rounds), desc="timed rounds", unit="round", disable=not progress):
        for k in range(len(order)):
            name = order[(r + k) % len(order)]  # rotate who goes first
            if torch.get_num_threads() != threads:
                raise RuntimeError(f"torch thread count changed to {torch.get_num_threads()} mid-run")
            start = time.perf_counter()
            loss = contestants[name].step(*batch)
            times[name].append(time.perf_counter() - start)
            losses[name].append(loss)
            for phase, seconds in getattr(contestants[name], "phases", {}).items():
                if seconds is not None:
                    phases[name].setdefault(phase, []).append(seconds)
    return times, losses, phases


def _versions() -> dict[str, str]:
    import deepspeed
    import open_clip
    import timm

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "open_clip": open_clip.__version__,
        "timm": timm.__version__,
    }


def contestant_name(side: str, mask: float, compiled: bool = False) -> str:
    return f"{side}{' compiled' if compiled else ''} mask={mask:g}"


def run_speed_benchmark(
    model: str = "ViT-B-16",
    batch_size: int = 8,
    steps: int = 9,
    warmup: int = 2,
    ds_config: str = DEFAULT_DS_CONFIG,
    output: str | Path | None = "runs/bench/speed.json",
    progress: bool = True,
    peak_tflops: float | None = None,
    precision: str = "auto",
    compiled: bool = False,
    trace_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Build the contestants, warm them up, time ``steps`` interleaved rounds; return (and write) the
    results. ``peak_tflops``: the device's peak in ``precision`` for MFU, where the training log's table
    has none; ``compiled``: the compiled contestants too; ``trace_dir``: a profiler trace of each."""
    import open_clip

    import eva_fastclip.models  # noqa: F401  (registers the shipped toy architectures with open_clip)

    if steps < 1 or warmup < 0 or batch_size < 1:
        raise ValueError("benchmarks.speed needs --steps >= 1, --warmup >= 0 and --batch-size >= 1")
    if peak_tflops is not None and not peak_tflops > 0:
        raise ValueError(f"benchmarks.speed needs --peak-tflops > 0, got {peak_tflops}")
    if model not in open_clip.list_models():
        raise ValueError(f"--model {model!r} is not an open_clip architecture")
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"--precision must be auto, bf16 or fp32, got {precision!r}")
    precision = native_precision() if precision == "auto" else precision
    _warn_if_bf16_is_emulated(precision)
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="eva_fastclip_bench_") as tmp:
        contestants, batch = _speed_contestants(model, batch_size, ds_config, tmp, precision, compiled)
        times, losses, phases = time_interleaved(contestants, batch, warmup, steps, threads, progress)
        traces = write_traces(contestants, batch, trace_dir) if trace_dir is not None else {}
        for contestant in contestants.values():
            contestant.close()
    by_name = {
        name: _contestant_result(times[name], losses[name], phases[name], batch_size) for name in contestants
    }
    flops = model_flops_per_mask(model)
    peak = _peak(peak_tflops, precision)
    for name, result in by_name.items():
        result.update(utilization(result, flops[name.rpartition("mask=")[2]], peak.tflops))
        if name in traces:
            result["trace"] = traces[name]
    results = {
        "config": {
            "model": model,
            "batch_size": batch_size,
            "precision": precision,
            "compiled": compiled,
            "rounds": steps,
            "warmup_steps": warmup,
            "masks": list(MASKS),
            "image_size": list(batch[0].shape[-2:]),
            "context_length": int(batch[1].shape[1]),
            "ours": f"Trainer.train_step, {ds_config} (DeepSpeed engine, train.precision={precision}, "
            "fp32 loss)",
            "openclip": f"open_clip model fp32{' + torch.autocast(bf16)' if precision == 'bf16' else ''}, "
            f"ClipLoss, torch.optim.AdamW (lr {OPENCLIP_LR}, betas {OPENCLIP_BETAS}, eps {OPENCLIP_EPS}, "
            f"wd {OPENCLIP_WD}); compiled: --torchcompile-strategy step (forward, backward, optimizer step "
            "in one torch.compile'd closure, lr a tensor)",
            "timing": "time.perf_counter around one step; rounds interleave the contestants round-robin, "
            "the first one rotating each round; median per contestant",
            "gflop_per_sample": {mask: f / 1e9 for mask, f in flops.items()},
            "flops": "model FLOPs per training sample, both sides alike: 3 x the forward's matrix products "
            "over the tokens the masking keeps (eva_fastclip/models/flops.py)",
            "peak_tflops": peak.tflops,
            "peak": peak.source,
        },
        "contestants": by_name,
        "ratios": speed_ratios(by_name),
        "environment": environment(threads),
    }
    return write_results(results, output)


def write_traces(contestants: dict[str, Any], batch, trace_dir: str | Path) -> dict[str, str]:
    """One more step of each contestant under ``torch.profiler``, its chrome trace in ``trace_dir``."""
    from torch.profiler import ProfilerActivity, profile

    folder = Path(trace_dir)
    folder.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    written = {}
    for name, contestant in contestants.items():
        with profile(activities=activities) as prof:
            contestant.step(*batch)
        path = folder / (name.replace(" ", "_").replace("=", "") + ".json")
        prof.export_chrome_trace(str(path))
        written[name] = str(path)
    return written


def model_flops_per_mask(model: str) -> dict[str, float]:
    """The training FLOPs of one sample of ``model`` at each masking, keyed as the contestants' names
    end ("0", "0.5"): the training log's count, the same for ours and OpenCLIP's (one architecture)."""
    from eva_fastclip.config import ModelConfig
    from eva_fastclip.models.flops import model_flops

    return {f"{mask:g}": model_flops(ModelConfig(name=model, patch_dropout=mask)).training for mask in MASKS}


def _peak(peak_tflops: float | None, precision: str):
    """The peak MFU divides by: ``--peak-tflops``, else the training log's table for this GPU."""
    from eva_fastclip.engine.throughput import Peak

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return Peak.find(peak_tflops, device, precision)


def utilization(result: dict[str, Any], flops: float, peak_tflops: float | None) -> dict[str, Any]:
    """A contestant's model TFLOP/s and MFU (None without a peak), of the whole step and of its forward and
    backward alone (the model's own work, without the step after the backward; None where the step is
    one compiled closure)."""
    phases = result["phases_median_s"]
    compute = phases["forward"] + phases["backward"] if phases else None
    tflops = result["samples_per_s"] * flops / 1e12
    compute_tflops = tflops * result["median_s"] / compute if compute else None
    return {
        "gflop_per_sample": flops / 1e9,
        "tflops": tflops,
        "mfu": tflops / peak_tflops if peak_tflops else None,
        "compute_tflops": compute_tflops,
        "compute_mfu": compute_tflops / peak_tflops if peak_tflops and compute_tflops else None,
    }


def _warn_if_bf16_is_emulated(precision: str) -> None:
    from eva_fastclip.plan.precision import detect_hardware

    hardware = detect_hardware()
    if precision == "bf16" and not hardware.native_bf16:
        warnings.warn(
            f"{hardware.description} only emulates bf16, which both contestants use: their ratio is like "
            "for like, but dominated by emulated matrix products (--precision auto picks fp32 here)",
            stacklevel=3,
        )


def _speed_contestants(
    model: str, batch_size: int, ds_config: str, tmp: str, precision: str, compiled: bool
) -> tuple[dict[str, Any], Any]:
    """The contestants in the report's order, and the one batch they all step on, built from the
    architecture's own sizes before any timing."""
    import open_clip

    contestants: dict[str, Any] = {}
    batch = None
    kinds = (False, True) if compiled else (False,)
    for mask in MASKS:
        for kind in kinds:
            name = contestant_name("openclip", mask, kind)
            contestants[name] = OpenClipStep(model, mask, precision, compiled=kind)
            if batch is None:
                oc = contestants[name].model
                context_length = open_clip.get_tokenizer(model).context_length
                batch = synthetic_batch(batch_size, image_size(oc), context_length, oc.vocab_size)
    for mask in MASKS:
        for kind in kinds:
            folder = str(Path(tmp) / f"ours_{mask:g}{'_compiled' if kind else ''}")
            contestants[contestant_name("ours", mask, kind)] = OursStep(
                model, mask, batch_size, batch, folder, ds_config, precision, compiled=kind
            )
    order = [
        contestant_name(side, mask, kind) for mask in MASKS for kind in kinds for side in ("ours", "openclip")
    ]
    return {name: contestants[name] for name in order}, batch


def _contestant_result(times: list[float], losses: list[float], phases: dict, batch_size: int) -> dict:
    median = statistics.median(times)
    phase_medians = {k: statistics.median(v) for k, v in phases.items()}
    return {
        "step_times_s": times,
        "median_s": median,
        "min_s": min(times),
        "samples_per_s": batch_size / median,
        "losses": losses,
        "phases_median_s": phase_medians,
        "after_backward_share": phase_medians["after_backward"] / median if phase_medians else None,
        "phase_times_s": phases,
    }


def speed_ratios(by_name: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Speed ratios (>1: the first named is faster): ours over OpenCLIP at equal masking, of the whole
    step, of the model's own work (forward + backward) and of the step after the backward; compiled over
    eager where the compiled contestants ran; each side's masking speed-up."""
    med = {name: r["median_s"] for name, r in by_name.items()}
    phases = {name: r["phases_median_s"] for name, r in by_name.items()}
    ratios = {}
    for mask in MASKS:
        m = f"mask{mask:g}"
        ours, oc = contestant_name("ours", mask), contestant_name("openclip", mask)
        ratios[f"ours_over_openclip_{m}"] = med[oc] / med[ours]
        # paired: each round's two steps ran side by side; a slow phase of the machine cancels out
        rounds = zip(by_name[ours]["step_times_s"], by_name[oc]["step_times_s"])
        ratios[f"paired_ours_over_openclip_{m}"] = statistics.median(theirs / mine for mine, theirs in rounds)
        compute = {n: phases[n]["forward"] + phases[n]["backward"] for n in (ours, oc)}
        ratios[f"compute_ours_over_openclip_{m}"] = compute[oc] / compute[ours]
        after = {n: phases[n]["after_backward"] for n in (ours, oc)}
        ratios[f"after_backward_ours_over_openclip_{m}"] = after[oc] / after[ours]
        ours_c, oc_c = contestant_name("ours", mask, True), contestant_name("openclip", mask, True)
        if ours_c in med:
            ratios[f"ours_compiled_over_openclip_{m}"] = med[oc] / med[ours_c]
            ratios[f"ours_compiled_over_openclip_compiled_{m}"] = med[oc_c] / med[ours_c]
            ratios[f"ours_compiled_over_ours_{m}"] = med[ours] / med[ours_c]
            ratios[f"openclip_compiled_over_openclip_{m}"] = med[oc] / med[oc_c]
    for side in ("ours", "openclip"):
        ratios[f"masking_speedup_{side}"] = med[contestant_name(side, 0.0)] / med[contestant_name(side, 0.5)]
    return ratios


def environment(threads: int) -> dict[str, Any]:
    """Versions, machine, threads and date: what a benchmark's results record beside their figures."""
    return {
        **_versions(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def write_results(results: dict[str, Any], output: str | Path | None) -> dict[str, Any]:
    """``results`` as JSON in ``output`` (unless None), its path then under ``"output"``."""
    if output is not None:
        path = Path(output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2))
        results["output"] = str(path)
    return results


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_report(results: dict[str, Any]) -> str:
    cfg, env = results["config"], results["environment"]
    gflop = ", ".join(f"mask {mask}: {value:.4g}" for mask, value in cfg["gflop_per_sample"].items())
    if cfg["peak_tflops"]:
        peak = f"MFU against a peak of {cfg['peak_tflops']:g} TFLOP/s ({cfg['peak']})"
    else:
        peak = f"no MFU: {cfg['peak']} (--peak-tflops sets one)"
    lines = [
        f"{cfg['model']}, batch {cfg['batch_size']}, {cfg['precision']}, {cfg['rounds']} interleaved rounds "
        f"(median), {env['torch_threads']} threads, {env['cuda'] or env['cpu_model']}",
        f"GFLOP per training sample, both sides: {gflop}; {peak}",
        f"{'contestant':<29} {'median s/step':>14} {'samples/s':>10} {'TFLOP/s':>8} {'MFU':>6} "
        f"{'fwd+bwd MFU':>12} {'forward':>8} {'backward':>9} {'after bwd':>10} {'share':>6}",
    ]
    for name, r in results["contestants"].items():
        ph = r["phases_median_s"]
        lines.append(
            f"{name:<29} {r['median_s']:>14.3f} {r['samples_per_s']:>10.2f} {r['tflops']:>8.3g} "
            f"{_percent(r['mfu']):>6} {_percent(r['compute_mfu']):>12} {_seconds(ph.get('forward')):>8} "
            f"{_seconds(ph.get('backward')):>9} {_seconds(ph.get('after_backward')):>10} "
            f"{_percent(r['after_backward_share']):>6}"
        )
    ratios = results["ratios"]
    lines.append("speed ratio (>1: the first faster)   mask 0   mask 0.5")
    rows = [
        ("ours / openclip, whole step", "ours_over_openclip"),
        ("  the same, paired by round", "paired_ours_over_openclip"),
        ("ours / openclip, forward+backward", "compute_ours_over_openclip"),
        ("ours / openclip, after the backward", "after_backward_ours_over_openclip"),
        ("ours compiled / openclip", "ours_compiled_over_openclip"),
        ("ours compiled / openclip compiled", "ours_compiled_over_openclip_compiled"),
        ("ours compiled / ours", "ours_compiled_over_ours"),
        ("openclip compiled / openclip", "openclip_compiled_over_openclip"),
    ]
    for label, key in rows:
        if f"{key}_mask0" in ratios:
            lines.append(f"{label:<36} {ratios[f'{key}_mask0']:>6.2f}x {ratios[f'{key}_mask0.5']:>9.2f}x")
    lines.append(
        f"masking speed-up: ours {ratios['masking_speedup_ours']:.2f}x, openclip "
        f"{ratios['masking_speedup_openclip']:.2f}x"
    )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.speed", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="ViT-B-16", help="open_clip architecture for both contestants")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=9, help="timed rounds (one step of each contestant each)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contestant first")
    p.add_argument("--deepspeed-config", default=DEFAULT_DS_CONFIG, help="our engine's JSON")
    p.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="both sides' precision (default auto: bf16 where the device computes it natively, else fp32)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also time both sides compiled: ours with train.compile, OpenCLIP's --torchcompile (step)",
    )
    p.add_argument("--trace-dir", default=None, help="a torch.profiler trace of one step of each here")
    p.add_argument("--output", default="runs/bench/speed.json", help="JSON file for all step times")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's dense peak TFLOP/s in the precision, for MFU (default: the training log's "
        "table: A100, H100, H200; none elsewhere)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    def run(args) -> int:
        results = run_speed_benchmark(
            model=args.model,
            batch_size=args.batch_size,
            steps=args.steps,
            warmup=args.warmup,
            ds_config=args.deepspeed_config,
            output=args.output,
            peak_tflops=args.peak_tflops,
            precision=args.precision,
            compiled=args.compile,
            trace_dir=args.trace_dir,
        )
        print(format_report(results), flush=True)
        print(f"full results: {results['output']}", flush=True)
        return 0

    return run_main(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
