"""The cost of the contrastive batch: cached accumulation against plain accumulation, one micro-batch of the
whole batch, and OpenCLIP's own ``--accum-freq`` step, side by side in one run.

    python -m benchmarks.accumulation --accumulate 4 --model ViT-B-16 --batch-size 32

Every contestant trains the same architecture on the same global batch G of synthetic pairs, in bf16, with
patch dropout 0 and 0.5:

- **ours one**: ``Trainer.train_step`` on one micro-batch of G (what the reference's GPUs run);
- **ours micro**: a micro-batches of G/a, ``train.contrastive_batch=micro`` (each loss sees G/a pairs);
- **ours global**: a micro-batches of G/a, ``train.contrastive_batch=global`` (the step of "one"; a pass
  without autograd first);
- **openclip accum**: open_clip_train's own ``train_one_epoch`` with ``--accum-freq a`` over a loader of
  the same a micro-batches (its no-grad pass, then each micro-batch's loss over the whole G×G), with its
  defaults (fp32 model under bf16 autocast, ``ClipLoss``, AdamW): OpenCLIP's step for the same batch.

Ours run the default engine (ZeRO-1, bf16 module, LAMB: ``ds_configs/zero1_bf16_lamb.json``) with OpenCLIP's
loss, so the two sides compute the same objective. Step times are medians of interleaved rounds
(``speed.time_interleaved``). Peak memory is measured on one more step of each contestant: the allocator's
peak above what the step started with (CUDA: ``max_memory_allocated``; CPU: c10's allocator as
``torch.profiler`` logs it, ``loss_memory.AllocatorPeak``), i.e. the step's activations, gradients,
features and temporaries, not the weights and moments every contestant holds alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks.command_line import run_main
from benchmarks.speed import MASKS, environment, time_interleaved, write_results
from benchmarks.step_contestants import OpenClipStep, bench_trainer, synthetic_batch
from benchmarks.step_contestants import image_size as _image_size

#: bf16 DeepSpeed engine against OpenCLIP's amp_bf16 (on a CPU without native bf16, both emulate it)
DEFAULT_DS_CONFIG = "ds_configs/zero1_bf16_lamb.json"

SIDES = ("ours one", "ours micro", "ours global", "openclip accum")


class OursAccumulated:
    """Our Trainer over the step's micro-batches: one of G, or ``accum`` of G/accum in a mode."""

    def __init__(self, arch, mask, batch, accum, contrastive, output_dir, ds_config) -> None:
        size = batch[0].shape[0] // accum
        extra = (f"train.grad_accum_steps={accum}", f"train.contrastive_batch={contrastive}")
        self.trainer = bench_trainer(arch, mask, size, batch, output_dir, ds_config, extra, accum)
        self.accum, self.size = accum, size

    @property
    def bucket_bytes(self) -> int:
        """DeepSpeed's gradient reduction buckets (ZeRO 1/2 with contiguous gradients), allocated anew at
        every backward's start: ``reduce_bucket_size`` elements whatever the model's size."""
        zero = self.trainer.engine.optimizer
        if not getattr(zero, "contiguous_gradients", False):
            return 0
        element = torch.empty((), dtype=zero._gradient_reduction_buffer_dtype()).element_size()
        return int(zero.reduce_bucket_size) * element * (2 if zero.overlap_comm else 1)

    def step(self, images, tokens, indices) -> float:
        for t in range(self.accum):
            rows = slice(t * self.size, (t + 1) * self.size)
            metrics = self.trainer.train_step(images[rows], tokens[rows], indices[rows])
        self.trainer.step += 1
        return metrics["loss"]

    def close(self) -> None:
        if self.trainer.writer is not None:
            self.trainer.writer.close()


class OpenClipAccumulated(OpenClipStep):
    """open_clip_train's ``train_one_epoch`` with ``accum_freq``: one epoch of ``accum`` batches is one
    optimizer step (scheduler and logging off)."""

    def __init__(self, arch: str, mask: float, accum: int) -> None:
        super().__init__(arch, mask)
        self.accum = accum
        self.args = SimpleNamespace(
            device=self.device_type, precision="amp_bf16", accum_freq=accum, distill=False,
            skip_scheduler=True, horovod=False, grad_clip_norm=None, log_every_n_steps=10**9, wandb=False,
            world_size=1, rank=0, local_rank=0, batch_size=None,
        )  # fmt: skip

    def step(self, images, tokens, indices) -> float:
        from open_clip_train.train import train_one_epoch

        size = images.shape[0] // self.accum
        loader = _Batches(
            [
                (images[t * size : (t + 1) * size], tokens[t * size : (t + 1) * size])
                for t in range(self.accum)
            ]
        )
        self.args.batch_size = size
        values = []

        def loss(**inputs):  # ClipLoss, its value noted: train_one_epoch returns nothing
            out = self.loss(**inputs)
            values.append(float(sum(v.detach() for v in out.values())))
            return out

        train_one_epoch(self.model, {"train": loader}, loss, 0, self.optimizer, None, None, None, self.args)
        return values[-1]


class _Batches:
    """What ``train_one_epoch`` reads of a loader: ``dataloader`` (iterable, ``num_batches``,
    ``num_samples``) and ``set_epoch``."""

    def __init__(self, batches) -> None:
        self.dataloader = self
        self.batches = batches
        self.num_batches = len(batches)
        self.num_samples = sum(len(b[0]) for b in batches)

    def set_epoch(self, epoch: int) -> None:
        pass

    def __iter__(self):
        return iter(self.batches)


def step_peak_bytes(contestant, batch) -> int:
    """The allocator's peak during one step, above what it held when the step began."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        contestant.step(*batch)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from benchmarks.loss_memory import AllocatorPeak

    with AllocatorPeak() as alloc:
        contestant.step(*batch)
    return alloc.peak


def run_accumulation_benchmark(
    model: str = "ViT-B-16",
    global_batch: int = 32,
    accum: int = 4,
    steps: int = 5,
    warmup: int = 1,
    ds_config: str = DEFAULT_DS_CONFIG,
    output: str | Path | None = "runs/bench/accumulation.json",
    progress: bool = True,
) -> dict[str, Any]:
    """Build the 8 contestants (4 sides x 2 masks), time ``steps`` interleaved rounds, measure each one's
    peak; return (and write) the results."""
    import open_clip

    import eva_fastclip.models  # noqa: F401  (registers the shipped toy architectures with open_clip)

    if accum < 2 or global_batch % accum or steps < 1 or warmup < 0:
        raise ValueError(
            f"benchmarks.accumulation needs --accumulate >= 2 dividing --batch-size ({global_batch}), "
            "--steps >= 1 and --warmup >= 0"
        )
    if model not in open_clip.list_models():
        raise ValueError(f"--model {model!r} is not an open_clip architecture")
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="eva_fastclip_bench_") as tmp:
        contestants, batch = _accumulation_contestants(model, global_batch, accum, ds_config, tmp)
        times, losses, _ = time_interleaved(contestants, batch, warmup, steps, threads, progress)
        peaks = {name: step_peak_bytes(contestant, batch) for name, contestant in contestants.items()}
        buckets = {name: getattr(c, "bucket_bytes", 0) for name, c in contestants.items()}
        for contestant in contestants.values():
            contestant.close()
    medians = {name: statistics.median(t) for name, t in times.items()}
    by_name = {
        name: {
            "step_times_s": times[name],
            "median_s": medians[name],
            "samples_per_s": global_batch / medians[name],
            "peak_bytes": peaks[name],
            "deepspeed_bucket_bytes": buckets[name],
            "losses": losses[name],
        }
        for name in contestants
    }
    results = {
        "config": {
            "model": model,
            "global_batch": global_batch,
            "accumulation": accum,
            "micro_batch": global_batch // accum,
            "rounds": steps,
            "warmup_steps": warmup,
            "masks": list(MASKS),
            "ours": f"Trainer.train_step, {ds_config}, loss openclip",
            "openclip": "open_clip_train.train.train_one_epoch, accum_freq, amp_bf16, ClipLoss, AdamW",
            "timing": "time.perf_counter around one optimizer step; interleaved rounds, rotating; median",
            "memory": "allocator peak of one more step above its start (CUDA max_memory_allocated; CPU: "
            "c10's allocator through torch.profiler); ratios without DeepSpeed's reduce bucket, which ours "
            "allocate alike at every backward (deepspeed_bucket_bytes)",
        },
        "contestants": by_name,
        "ratios": accumulation_ratios(medians, peaks, buckets),
        "environment": environment(threads),
    }
    return write_results(results, output)


def _accumulation_contestants(
    model: str, global_batch: int, accum: int, ds_config: str, tmp: str
) -> tuple[dict[str, Any], Any]:
    """The 8 contestants in the report's order, and the one global batch they all step on."""
    import open_clip

    contestants: dict[str, Any] = {}
    batch = None
    for mask in MASKS:
        contestants[f"openclip accum mask={mask:g}"] = oc = OpenClipAccumulated(model, mask, accum)
        if batch is None:
            context_length = open_clip.get_tokenizer(model).context_length
            batch = synthetic_batch(global_batch, _image_size(oc.model), context_length, oc.model.vocab_size)
        for side, a, mode in (("one", 1, "micro"), ("micro", accum, "micro"), ("global", accum, "global")):
            folder = str(Path(tmp) / f"{side}_{mask:g}")
            contestants[f"ours {side} mask={mask:g}"] = OursAccumulated(
                model, mask, batch, a, mode, folder, ds_config
            )
    order = [f"{side} mask={mask:g}" for mask in MASKS for side in SIDES]
    return {name: contestants[name] for name in order}, batch


def accumulation_ratios(
    medians: dict[str, float], peaks: dict[str, int], buckets: dict[str, int]
) -> dict[str, float]:
    """Ours global over the other sides, in time and in peak memory, per mask."""
    # the same bucket in every one of ours: compared without it, and stated beside
    net = {name: peaks[name] - buckets[name] for name in peaks}
    ratios = {}
    for mask in MASKS:
        m = f"mask={mask:g}"
        ratios[f"global_over_micro_time_{m}"] = medians[f"ours global {m}"] / medians[f"ours micro {m}"]
        ratios[f"global_over_openclip_accum_time_{m}"] = (
            medians[f"ours global {m}"] / medians[f"openclip accum {m}"]
        )
        ratios[f"global_over_one_time_{m}"] = medians[f"ours global {m}"] / medians[f"ours one {m}"]
        ratios[f"global_over_micro_peak_{m}"] = net[f"ours global {m}"] / net[f"ours micro {m}"]
        ratios[f"global_over_one_peak_{m}"] = net[f"ours global {m}"] / net[f"ours one {m}"]
        ratios[f"global_over_openclip_accum_peak_{m}"] = net[f"ours global {m}"] / net[f"openclip accum {m}"]
    return ratios


def format_accumulation_report(results: dict[str, Any]) -> str:
    cfg, env = results["config"], results["environment"]
    lines = [
        f"{cfg['model']}, global batch {cfg['global_batch']} = {cfg['accumulation']} x {cfg['micro_batch']}, "
        f"bf16, {cfg['rounds']} interleaved rounds (median), {env['torch_threads']} threads, "
        f"{env['cuda'] or env['cpu_model']}",
        f"{'contestant':<26} {'median s/step':>14} {'samples/s':>10} {'peak MiB':>9} {'w/o DS bucket':>14}",
    ]
    for name, r in results["contestants"].items():
        peak, bucket = r["peak_bytes"] / 2**20, r["deepspeed_bucket_bytes"] / 2**20
        speed = f"{r['median_s']:>14.3f} {r['samples_per_s']:>10.2f}"
        lines.append(f"{name:<26} {speed} {peak:>9.1f} {peak - bucket:>14.1f}")
    ratios = results["ratios"]
    lines.append("ratio (ours global over ...)     time mask 0  time mask 0.5  peak mask 0  peak mask 0.5")
    lines.append("(peaks without DeepSpeed's reduce bucket, the same in each of ours)")
    for other, label in (("micro", "ours micro"), ("one", "ours one"), ("openclip_accum", "openclip accum")):
        row = [
            ratios.get(f"global_over_{other}_{kind}_mask={m:g}") for kind in ("time", "peak") for m in MASKS
        ]
        lines.append(f"{label:<32}" + "".join(f"{v:>13.2f}x" for v in row))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.accumulation", description=__doc__.splitlines()[0])
    p.add_argument(
        "--accumulate",
        type=int,
        default=4,
        metavar="A",
        help="the global batch --batch-size in A micro-batches, micro and global contrastive batch against "
        "one micro-batch and OpenCLIP's --accum-freq A step (time and peak memory; default 4)",
    )
    p.add_argument("--model", default="ViT-B-16", help="open_clip architecture for every contestant")
    p.add_argument("--batch-size", type=int, default=8, help="the global batch")
    p.add_argument("--steps", type=int, default=5, help="timed rounds (one step of each contestant each)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contestant first")
    p.add_argument("--deepspeed-config", default=DEFAULT_DS_CONFIG, help="our engine's JSON")
    p.add_argument("--output", default="runs/bench/accumulation.json", help="JSON file for all results")
    return p


def main(argv: list[str] | None = None) -> int:
    def run(args) -> int:
        results = run_accumulation_benchmark(
            model=args.model,
            global_batch=args.batch_size,
            accum=args.accumulate,
            steps=args.steps,
            warmup=args.warmup,
            ds_config=args.deepspeed_config,
            output=args.output,
        )
        print(format_accumulation_report(results), flush=True)
        print(f"full results: {results['output']}", flush=True)
        return 0

    return run_main(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
