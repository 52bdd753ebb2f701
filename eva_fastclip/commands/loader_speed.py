"""``eva-fastclip loader-speed``: how fast our training loader reads the config's own shards on this machine,
for each worker count, and how many workers keep up with what rate.

A diagnostic of the user's own setup, so it stays a command (the comparison against OpenCLIP's loader on
synthetic photos is a benchmark: ``python -m benchmarks.data_loader``). The loader is built as training
builds it on one rank (the shards, transform, tokenizer and data.* settings of the config, the micro-batch
and accumulation of its layout on 1 rank) and timed as the benchmark times ours
(eva_fastclip/data/throughput.py): samples per second of wall time and per CPU-second of this process
plus its workers, and the workers' peak memory. Where a GPU is present every batch is also made into the
model's input there, as the trainer makes it (with ``data.image_decode=gpu``, the decode itself).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from eva_fastclip.commands.common import add_config_args

HELP = "time the training loader on the config's own shards, one row per worker count"
#: timed micro-batches per worker count unless --batches says otherwise (fewer where an epoch is shorter)
DEFAULT_BATCHES = 50
#: a worker count "keeps up" when its rate is within this fraction of the fastest row's
WITHIN = 0.05


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[1, 2, 4],
        help="DataLoader worker counts to time, one row each (0: the loader in this process; default 1 2 4)",
    )
    p.add_argument(
        "--batches",
        type=int,
        default=None,
        help=f"timed micro-batches per worker count (default: {DEFAULT_BATCHES}, fewer where an epoch of "
        "the shards is shorter)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=5,
        help="micro-batches read before the timed window (worker start, the shuffle buffer filling)",
    )


def run(args) -> int:
    from eva_fastclip.config import load_config

    cfg = load_config(args.config, args.overrides)
    results = loader_speed(cfg, args.workers, warmup=args.warmup, batches=args.batches, progress=True)
    print(format_report(results), flush=True)
    return 0


def loader_speed(
    cfg, workers: list[int], *, warmup: int = 5, batches: int | None = None, progress: bool = False
) -> dict[str, Any]:
    """One measured window of our TrainLoader per worker count in ``workers``; the settings and the rows.
    Bad shards, a bad model or a bad image decode raise preflight's errors before any work."""
    from eva_fastclip.data.throughput import descendants, measure, on_device, wait_for_workers_to_exit
    from eva_fastclip.data.workers import start_worker_server

    if any(w < 0 for w in workers) or warmup < 1 or (batches is not None and batches < 1):
        raise ValueError(f"--workers {workers} must be >= 0, --warmup {warmup} and --batches >= 1")
    make, settings = _training_loader(cfg)
    per_epoch = make(0).num_batches  # no workers start: only the epoch's length is read
    timed = {w: _window(per_epoch, w, warmup, batches, settings["micro_batch"]) for w in workers}
    device = settings["device"]
    if any(workers):
        start_worker_server()  # once, as a rank does: among the processes each window leaves out
    rows = []
    for w in workers:
        others = set(descendants())
        loader = make(w)
        stream = loader if device is None else on_device(loader, device)
        label = f"{w} worker(s)" if progress else None
        row = measure(stream, warmup, timed[w], workers=w, progress=label)
        del stream, loader
        wait_for_workers_to_exit(others)
        rows.append({"workers": w, "timed_batches": timed[w], **row})
    return {**settings, "warmup": warmup, "rows": rows}


def _training_loader(cfg):
    """A function of the worker count that builds the TrainLoader as a training rank builds it (of 1
    rank: the run plan's layout), and what the report says of it; preflight's errors first."""
    import torch

    from eva_fastclip.data import TrainLoader
    from eva_fastclip.models import create_model
    from eva_fastclip.plan import preflight
    from eva_fastclip.plan.deepspeed_json import load_deepspeed_config
    from eva_fastclip.plan.precision import detect_hardware
    from eva_fastclip.plan.run_plan import make_plan

    urls, sizes, problems = preflight.train_data(cfg)
    preflight.raise_for_errors(problems + preflight.check_model(cfg) + preflight.check_image_decode(cfg))
    ds = load_deepspeed_config(cfg.train.deepspeed_config)
    layout = make_plan(cfg, ds, world_size=1, hardware=detect_hardware(), inputs=False).layout
    bundle = create_model(cfg.model)  # the transform and tokenizer training uses; the model is dropped
    preprocess, tokenize = bundle.preprocess_train, bundle.tokenizer
    del bundle
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else None

    def make(workers: int) -> TrainLoader:
        return TrainLoader.for_run(
            cfg,
            micro_batch=layout.micro_batch,
            accumulation=layout.grad_accum_steps,
            preprocess=preprocess,
            tokenize=tokenize,
            needs_index=preflight.needs_index(cfg),
            device=device,
            sizes=sizes,
            workers=workers,
        )

    settings = {
        "shards": len(urls),
        "samples_per_epoch": sizes.num_samples,
        "micro_batch": layout.micro_batch,
        "model": cfg.model.name,
        "image_decode": cfg.data.image_decode,
        "config_workers": cfg.data.workers,
        "device": device,
    }
    return make, settings


def _window(per_epoch: int, workers: int, warmup: int, batches: int | None, micro: int) -> int:
    """The timed micro-batches of one row: within one epoch, each worker keeping two to spare (a worker
    that has handed its share over may exit, and the window counts every worker throughout)."""
    room = per_epoch - warmup - 2 * workers
    timed = min(DEFAULT_BATCHES, room) if batches is None else batches
    if timed < 1 or timed > room:
        raise ValueError(
            f"an epoch of the shards holds {per_epoch} micro-batches of {micro}: --warmup {warmup} and "
            f"{timed} timed ones (--batches) with {workers} worker(s), each keeping 2 to spare, do not fit; "
            "lower --warmup/--batches or point data.train_shards at more shards"
        )
    return timed


def format_report(results: dict[str, Any]) -> str:
    """The settings, one row per worker count, and the line that says which count keeps up with what."""
    r = results
    where = f"made into model input on {r['device']}" if r["device"] is not None else "the loader alone"
    lines = [
        f"TrainLoader on data.train_shards ({r['shards']} shard(s), {r['samples_per_epoch']} samples an "
        f"epoch), micro-batches of {r['micro_batch']} (the layout on 1 rank), {r['model']}'s training "
        f"transform, data.image_decode={r['image_decode']}; {r['warmup']} warm-up micro-batches, then "
        f"the timed ones; {where}",
        f"{'workers':>7} {'timed':>6} {'samples/s':>10} {'samples/CPU-s':>14} {'worker peak RSS MiB':>20} "
        f"{'worker peak private MiB':>24}  batch",
    ]
    for row in r["rows"]:
        batch = f"{row['image_dtype']}, {row['batch_bytes'] / 2**20:.1f} MiB"
        lines.append(
            f"{row['workers']:>7} {row['timed_batches']:>6} {row['samples_per_s']:>10.1f} "
            f"{row['samples_per_cpu_s']:>14.1f} {row['worker_peak_rss_mib']:>20.0f} "
            f"{row['worker_peak_private_mib']:>24.0f}  {batch}"
        )
    lines.append(keeps_up(r))
    return "\n".join(lines)


def keeps_up(results: dict[str, Any]) -> str:
    """The fewest workers within WITHIN of the fastest row, the rate they keep up with, and the others."""
    rows, micro = results["rows"], results["micro_batch"]
    best = max(row["samples_per_s"] for row in rows)
    enough = min((r for r in rows if r["samples_per_s"] >= (1 - WITHIN) * best), key=lambda r: r["workers"])
    rate = enough["samples_per_s"]
    others = "".join(
        f"; {row['workers']} worker(s): up to {row['samples_per_s']:.0f}" for row in rows if row is not enough
    )
    return (
        f"data.workers={enough['workers']} keeps up with a rank training at up to {rate:.0f} samples/s "
        f"({rate / micro:.1f} micro-batches of {micro} a second; no other row is over {WITHIN:.0%} faster)"
        f"{others}. The config sets data.workers={results['config_workers']}."
    )
