"""``eva-fastclip tune``: the fastest layout of the config's global batch that fits the GPUs (exit 5: the
device cannot be used)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eva_fastclip.commands.common import add_config_args

HELP = (
    "find the fastest layout of the config's global batch that fits the GPUs (micro-batch, "
    "checkpointing, ZeRO stage, contrastive batch, loader workers); launch it like train"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument(
        "--output", default="tuned.json", help="the tuned config (beside it: .ds.json, .trials.json)"
    )
    p.add_argument(
        "--memory-limit-gib",
        type=float,
        default=None,
        help="memory per rank to fit in (default: the GPU's; on a CPU the machine's RAM over its ranks)",
    )
    p.add_argument(
        "--memory-margin", type=float, default=0.10, help="fraction of the limit kept free (default 0.1)"
    )
    p.add_argument(
        "--contrastive-batch",
        type=int,
        default=None,
        help="the pairs each loss evaluation should see (default: the global batch, the reference's)",
    )
    p.add_argument(
        "--no-data", action="store_true", help="keep data.workers and data.image_decode as they are"
    )
    p.add_argument(
        "--probe-steps",
        type=int,
        default=3,
        help="optimizer steps a probe times after its untimed first (default 3; fewer: a quicker, noisier "
        "speed; the peak is reached in the first timed step)",
    )
    p.add_argument(
        "--estimate-only",
        action="store_true",
        help="plan for other GPUs from the memory model alone (with --gpus and --gpu-memory-gib)",
    )
    p.add_argument("--gpus", type=int, default=None, help="ranks of the planned run (--estimate-only)")
    p.add_argument(
        "--gpu-memory-gib", type=float, default=None, help="memory of each planned GPU (--estimate-only)"
    )


def run(args) -> int:
    from eva_fastclip.config import config_from_raw, read_raw_config
    from eva_fastclip.plan.deepspeed_json import load_deepspeed_config
    from eva_fastclip.reliability.watchdog import Watchdog
    from eva_fastclip.tune import TuneOptions, Tuner
    from eva_fastclip.tune.probe import DeviceUnusable

    raw = read_raw_config(args.config, args.overrides)
    cfg = config_from_raw(raw)
    ds = load_deepspeed_config(cfg.train.deepspeed_config)
    opts = TuneOptions(
        output=Path(args.output),
        memory_limit_gib=args.memory_limit_gib,
        margin=args.memory_margin,
        contrastive_batch=args.contrastive_batch,
        estimate_only=args.estimate_only,
        gpus=args.gpus,
        gpu_memory_gib=args.gpu_memory_gib,
        data=not args.no_data,
        probe_steps=args.probe_steps,
    )
    if opts.estimate_only:
        Tuner(cfg, raw, ds, opts).run()
        return 0
    try:
        with Watchdog.for_run(cfg.train) as dog:
            Tuner(cfg, raw, ds, opts, watchdog=dog).run()
    except DeviceUnusable as err:
        print(f"eva-fastclip tune: stopped: {err}", file=sys.stderr)
        return 5
    return 0
