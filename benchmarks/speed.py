"""Training-step speed: our DeepSpeed step against OpenCLIP's own step, with and without 50% masking.

    python -m benchmarks.speed [--model ViT-B-16] [--batch-size 8] [--steps 5] [--warmup 2]

Four contestants, (ours, openclip) x (patch dropout 0.0, 0.5), share one process, one architecture, one
batch size and one precision (bf16). Each is warmed up, then the timed steps are interleaved round-robin
(one step of each contestant per round, the starting contestant rotating), so a slow phase of the machine
hits all four alike. Reported: the median step time of each, samples/s, and two kinds of ratios: ours over
OpenCLIP at equal masking, and each side's speed-up from masking. On CPU only the ratios mean anything.
Both sides' TFLOP/s and MFU use one FLOP count per masking, the training log's (eva_fastclip/models/flops.py:
3 x the forward's matrix products over the kept tokens) and its peak table (eva_fastclip/engine/throughput.py:
A100, H100, H200 in bf16); ``--peak-tflops`` gives the peak elsewhere.

- **ours**: ``Trainer.train_step`` — the DeepSpeed engine (ZeRO-1, bf16 module, LAMB by default:
  ``ds_configs/zero1_bf16_lamb.json``), our loss in fp32, ``engine.backward``, ``engine.step``, hooks.
- **openclip**: the step of open_clip's trainer (``open_clip_train/train.py``) with its defaults: an fp32
  model under ``torch.autocast(bfloat16)`` for forward and ``ClipLoss``, ``loss.backward()``,
  ``torch.optim.AdamW`` over open_clip's parameter groups, ``zero_grad``, logit_scale clamped to [0, ln 100].
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
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
from eva_fastclip.plan.precision import cpu_model

MASKS = (0.0, 0.5)
DEFAULT_DS_CONFIG = "ds_configs/zero1_bf16_lamb.json"

# open_clip_train's defaults for ViT models (params.py: get_default_params) and its step's clamp
OPENCLIP_LR, OPENCLIP_BETAS, OPENCLIP_EPS, OPENCLIP_WD = 5e-4, (0.9, 0.98), 1e-6, 0.2
LOGIT_SCALE_MAX = math.log(100.0)


# ---- data ---------------------------------------------------------------------------------------------


class SyntheticLoader:
    """The same pre-built batch again and again: what ``Trainer`` needs from a loader, and nothing more."""

    def __init__(self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], num_batches: int) -> None:
        self.batch = batch
        self.num_batches = num_batches
        self.dataset_size = int(batch[2].max()) + 1  # indices are 0..B-1

    def set_epoch(self, epoch: int) -> None:
        pass

    def __iter__(self):
        for _ in range(self.num_batches):
            yield self.batch


def synthetic_batch(
    batch_size: int, image_size: tuple[int, int], context_length: int, vocab_size: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random images (fp32, normalised-looking), random token ids, indices 0..B-1."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, 3, *image_size, generator=gen)
    tokens = torch.randint(1, vocab_size, (batch_size, context_length), generator=gen, dtype=torch.long)
    return images, tokens, torch.arange(batch_size)


def _image_size(model: torch.nn.Module) -> tuple[int, int]:
    size = model.visual.image_size
    return (size, size) if isinstance(size, int) else tuple(size)


# ---- contestants --------------------------------------------------------------------------------------


class OpenClipStep:
    """OpenCLIP's training step (accum_freq 1, amp_bf16, no grad clipping: open_clip_train's defaults)."""

    def __init__(self, arch: str, patch_dropout: float, precision: str = "bf16") -> None:
        import open_clip

        import eva_fastclip.models  # noqa: F401  (registers the shipped toy architectures with open_clip)

        self.model = open_clip.create_model(
            arch, force_patch_dropout=patch_dropout, pretrained_text=False, output_dict=True
        )
        self.model.train()
        self.loss = open_clip.loss.ClipLoss()
        # open_clip_train/main.py: no weight decay on gains, biases and the temperature
        exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n  # noqa: E731
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for n, p in named if exclude(n, p)], "weight_decay": 0.0},
                {"params": [p for n, p in named if not exclude(n, p)], "weight_decay": OPENCLIP_WD},
            ],
            lr=OPENCLIP_LR,
            betas=OPENCLIP_BETAS,
            eps=OPENCLIP_EPS,
        )
        # open_clip_train's --precision amp_bf16 (autocast over an fp32 model) or fp32 (no autocast)
        self.autocast = precision == "bf16"
        self.device_type = "cpu" if not torch.cuda.is_available() else "cuda"
        self.device = torch.device(self.device_type)
        self.model.to(self.device)

    def step(self, images: torch.Tensor, tokens: torch.Tensor, indices: torch.Tensor) -> float:
        start = time.perf_counter()
        images = images.to(self.device, non_blocking=True)
        tokens = tokens.to(self.device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=self.device_type, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model(images, tokens)
            loss = self.loss(out["image_features"], out["text_features"], out["logit_scale"])
        forward_done = _synchronized_time()
        loss.backward()
        backward_done = _synchronized_time()
        self.optimizer.step()
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, LOGIT_SCALE_MAX)
        value = loss.item()
        self.phases = {
            "forward": forward_done - start,
            "backward": backward_done - forward_done,
            "optimizer": time.perf_counter() - backward_done,
        }
        return value

    def close(self) -> None:
        pass


def bench_trainer(
    arch: str,
    patch_dropout: float,
    batch_size: int,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    output_dir: str,
    ds_config_path: str = DEFAULT_DS_CONFIG,
    extra: tuple[str, ...] = (),
    micro_batches: int = 1,
):
    """A Trainer of the default recipe with OpenCLIP's loss, fed ``batch`` by a synthetic loader (an epoch
    of ``micro_batches``: the caller feeds ``train_step`` itself)."""
    from eva_fastclip.config import load_config
    from eva_fastclip.engine.build import build_trainer
    from eva_fastclip.plan.deepspeed_json import load_deepspeed_config

    cfg = load_config(
        None,
        [
            f"model.name={arch}",
            f"model.patch_dropout={patch_dropout}",
            "loss.name=openclip",  # the same loss as OpenCLIP's ClipLoss: the step is what we compare
            f"train.batch_size={batch_size}",
            "train.steps=1000000",
            f"train.deepspeed_config={ds_config_path}",
            f"train.output_dir={output_dir}",
            "train.log_every_steps=1000000",
            "eval.every_steps=0",  # and no zero-shot / retrieval sets: evaluation off
            *extra,
        ],
    )
    return build_trainer(
        cfg, load_deepspeed_config(ds_config_path), loader=SyntheticLoader(batch, micro_batches)
    )


class OursStep:
    """Our ``Trainer.train_step``, on a Trainer built from the default recipe with a synthetic loader."""

    def __init__(
        self,
        arch: str,
        patch_dropout: float,
        batch_size: int,
        batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        output_dir: str,
        ds_config_path: str = DEFAULT_DS_CONFIG,
    ) -> None:
        self.trainer = bench_trainer(arch, patch_dropout, batch_size, batch, output_dir, ds_config_path)
        # phase timers around the engine's own backward and step (the trainer calls them by attribute)
        engine = self.trainer.engine
        self._marks: dict[str, float] = {}
        for phase, method in (("backward", engine.backward), ("step", engine.step)):
            engine.__dict__[phase] = self._timed(phase, method)

    def _timed(self, phase: str, method):
        def run(*args, **kwargs):
            self._marks[phase + "_start"] = _synchronized_time()
            out = method(*args, **kwargs)
            self._marks[phase + "_end"] = _synchronized_time()
            return out

        return run

    def step(self, images: torch.Tensor, tokens: torch.Tensor, indices: torch.Tensor) -> float:
        start = time.perf_counter()
        metrics = self.trainer.train_step(images, tokens, indices)
        end = time.perf_counter()
        self.trainer.step += 1
        m = self._marks
        self.phases = {  # forward: the model and the loss; optimizer: the engine's step and our hooks
            "forward": m["backward_start"] - start,
            "backward": m["backward_end"] - m["backward_start"],
            "optimizer": end - m["backward_end"],
        }
        return metrics["loss"]

    def close(self) -> None:
        if self.trainer.writer is not None:
            self.trainer.writer.close()


def _synchronized_time() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


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


def contestant_name(side: str, mask: float) -> str:
    return f"{side} mask={mask:g}"


def run_speed_benchmark(
    model: str = "ViT-B-16",
    batch_size: int = 8,
    steps: int = 5,
    warmup: int = 2,
    ds_config: str = DEFAULT_DS_CONFIG,
    output: str | Path | None = "runs/bench/speed.json",
    progress: bool = True,
    peak_tflops: float | None = None,
) -> dict[str, Any]:
    """Build the four contestants, warm them up, time ``steps`` interleaved rounds; return (and write) the
    results. ``peak_tflops``: the device's bf16 peak for MFU, where the training log's table has none."""
    import open_clip

    import eva_fastclip.models  # noqa: F401  (registers the shipped toy architectures with open_clip)

    if steps < 1 or warmup < 0 or batch_size < 1:
        raise ValueError("benchmarks.speed needs --steps >= 1, --warmup >= 0 and --batch-size >= 1")
    if peak_tflops is not None and not peak_tflops > 0:
        raise ValueError(f"benchmarks.speed needs --peak-tflops > 0, got {peak_tflops}")
    if model not in open_clip.list_models():
        raise ValueError(f"--model {model!r} is not an open_clip architecture")
    _warn_if_bf16_is_emulated()
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="eva_fastclip_bench_") as tmp:
        contestants, batch = _speed_contestants(model, batch_size, ds_config, tmp)
        times, losses, phases = time_interleaved(contestants, batch, warmup, steps, threads, progress)
        for contestant in contestants.values():
            contestant.close()
    by_name = {
        name: _contestant_result(times[name], losses[name], phases[name], batch_size) for name in contestants
    }
    flops = model_flops_per_mask(model)
    peak = _peak(peak_tflops)
    for name, result in by_name.items():
        result.update(utilization(result, flops[name.rpartition("mask=")[2]], peak.tflops))
    results = {
        "config": {
            "model": model,
            "batch_size": batch_size,
            "rounds": steps,
            "warmup_steps": warmup,
            "masks": list(MASKS),
            "image_size": list(batch[0].shape[-2:]),
            "context_length": int(batch[1].shape[1]),
            "ours": f"Trainer.train_step, {ds_config} (DeepSpeed engine, bf16 module, fp32 loss)",
            "openclip": "open_clip model fp32 + torch.autocast(bf16), ClipLoss, torch.optim.AdamW "
            f"(lr {OPENCLIP_LR}, betas {OPENCLIP_BETAS}, eps {OPENCLIP_EPS}, wd {OPENCLIP_WD})",
            "timing": "time.perf_counter around one step; rounds interleave the four contestants "
            "round-robin, the first one rotating each round; median per contestant",
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


def model_flops_per_mask(model: str) -> dict[str, float]:
    """The training FLOPs of one sample of ``model`` at each masking, keyed as the contestants' names
    end ("0", "0.5"): the training log's count, the same for ours and OpenCLIP's (one architecture)."""
    from eva_fastclip.config import ModelConfig
    from eva_fastclip.models.flops import model_flops

    return {f"{mask:g}": model_flops(ModelConfig(name=model, patch_dropout=mask)).training for mask in MASKS}


def _peak(peak_tflops: float | None):
    """The bf16 peak MFU divides by: ``--peak-tflops``, else the training log's table for this GPU."""
    from eva_fastclip.engine.throughput import Peak

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return Peak.find(peak_tflops, device, "bf16")


def utilization(result: dict[str, Any], flops: float, peak_tflops: float | None) -> dict[str, Any]:
    """A contestant's model TFLOP/s and MFU (None without a peak), of the whole step and of its forward and
    backward alone (the model's own work, without the optimizer step)."""
    compute = result["phases_median_s"]["forward"] + result["phases_median_s"]["backward"]
    tflops = result["samples_per_s"] * flops / 1e12
    compute_tflops = tflops * result["median_s"] / compute if compute > 0 else None
    return {
        "gflop_per_sample": flops / 1e9,
        "tflops": tflops,
        "mfu": tflops / peak_tflops if peak_tflops else None,
        "compute_tflops": compute_tflops,
        "compute_mfu": compute_tflops / peak_tflops if peak_tflops and compute_tflops else None,
    }


def _warn_if_bf16_is_emulated() -> None:
    from eva_fastclip.plan.precision import detect_hardware

    hardware = detect_hardware()
    if not hardware.native_bf16:  # both contestants run bf16: the ratio holds, the absolute times do not
        warnings.warn(
            f"{hardware.description} only emulates bf16, which both contestants use: their ratio is like "
            "for like, but neither time says anything about training here (train.precision=auto picks fp32)",
            stacklevel=3,
        )


def _speed_contestants(model: str, batch_size: int, ds_config: str, tmp: str) -> tuple[dict[str, Any], Any]:
    """The four contestants in the report's order, and the one batch they all step on, built from the
    architecture's own sizes before any timing."""
    import open_clip

    contestants: dict[str, Any] = {}
    batch = None
    for mask in MASKS:
        name = contestant_name("openclip", mask)
        contestants[name] = OpenClipStep(model, mask)
        if batch is None:
            oc = contestants[name].model
            context_length = open_clip.get_tokenizer(model).context_length
            batch = synthetic_batch(batch_size, _image_size(oc), context_length, oc.vocab_size)
    for mask in MASKS:
        name = contestant_name("ours", mask)
        folder = str(Path(tmp) / f"ours_{mask:g}")
        contestants[name] = OursStep(model, mask, batch_size, batch, folder, ds_config)
    order = [contestant_name(side, mask) for mask in MASKS for side in ("ours", "openclip")]
    return {name: contestants[name] for name in order}, batch


def _contestant_result(times: list[float], losses: list[float], phases: dict, batch_size: int) -> dict:
    median = statistics.median(times)
    return {
        "step_times_s": times,
        "median_s": median,
        "min_s": min(times),
        "samples_per_s": batch_size / median,
        "losses": losses,
        "phases_median_s": {k: statistics.median(v) for k, v in phases.items()},
        "phase_times_s": phases,
    }


def speed_ratios(by_name: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Ours over OpenCLIP at equal masking and each side's masking speed-up (>1: the first is faster), of
    the whole step and of the model's own work (forward + backward, without the optimizer step)."""
    med = {name: r["median_s"] for name, r in by_name.items()}
    compute = {
        name: r["phases_median_s"]["forward"] + r["phases_median_s"]["backward"]
        for name, r in by_name.items()
    }
    o0, o5 = contestant_name("ours", 0.0), contestant_name("ours", 0.5)
    c0, c5 = contestant_name("openclip", 0.0), contestant_name("openclip", 0.5)
    ratios = {}
    for prefix, t in (("", med), ("compute_", compute)):
        ratios |= {
            f"{prefix}ours_over_openclip_mask0": t[c0] / t[o0],
            f"{prefix}ours_over_openclip_mask0.5": t[c5] / t[o5],
            f"{prefix}masking_speedup_ours": t[o0] / t[o5],
            f"{prefix}masking_speedup_openclip": t[c0] / t[c5],
        }
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


def format_report(results: dict[str, Any]) -> str:
    cfg, env = results["config"], results["environment"]
    gflop = ", ".join(f"mask {mask}: {value:.4g}" for mask, value in cfg["gflop_per_sample"].items())
    if cfg["peak_tflops"]:
        peak = f"MFU against a peak of {cfg['peak_tflops']:g} TFLOP/s ({cfg['peak']})"
    else:
        peak = f"no MFU: {cfg['peak']} (--peak-tflops sets one)"
    lines = [
        f"{cfg['model']}, batch {cfg['batch_size']}, bf16, {cfg['rounds']} interleaved rounds "
        f"(median), {env['torch_threads']} threads, {env['cpu_model']}",
        f"GFLOP per training sample, both sides: {gflop}; {peak}",
        f"{'contestant':<20} {'median s/step':>14} {'samples/s':>10} {'TFLOP/s':>8} {'MFU':>6} "
        f"{'fwd+bwd MFU':>12} {'forward':>8} {'backward':>9} {'optimizer':>10}",
    ]
    for name, r in results["contestants"].items():
        ph = r["phases_median_s"]
        lines.append(
            f"{name:<20} {r['median_s']:>14.3f} {r['samples_per_s']:>10.2f} {r['tflops']:>8.3g} "
            f"{_percent(r['mfu']):>6} {_percent(r['compute_mfu']):>12} {ph['forward']:>8.3f} "
            f"{ph['backward']:>9.3f} {ph['optimizer']:>10.3f}"
        )
    ratios = results["ratios"]
    lines += [
        "speed ratio (>1: ours faster)   whole step   forward+backward",
        f"ours / openclip, mask 0:        {ratios['ours_over_openclip_mask0']:>9.2f}x "
        f"{ratios['compute_ours_over_openclip_mask0']:>17.2f}x",
        f"ours / openclip, mask 0.5:      {ratios['ours_over_openclip_mask0.5']:>9.2f}x "
        f"{ratios['compute_ours_over_openclip_mask0.5']:>17.2f}x",
        f"masking speed-up, ours:         {ratios['masking_speedup_ours']:>9.2f}x "
        f"{ratios['compute_masking_speedup_ours']:>17.2f}x",
        f"masking speed-up, openclip:     {ratios['masking_speedup_openclip']:>9.2f}x "
        f"{ratios['compute_masking_speedup_openclip']:>17.2f}x",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.speed", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="ViT-B-16", help="open_clip architecture for both contestants")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="timed rounds (one step of each contestant each)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contestant first")
    p.add_argument("--deepspeed-config", default=DEFAULT_DS_CONFIG, help="our engine's JSON")
    p.add_argument("--output", default="runs/bench/speed.json", help="JSON file for all step times")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's dense bf16 peak TFLOP/s for MFU (default: the training log's table: A100, H100, "
        "H200; none elsewhere)",
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
        )
        print(format_report(results), flush=True)
        print(f"full results: {results['output']}", flush=True)
        return 0

    return run_main(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
