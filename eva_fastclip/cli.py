"""Command line: ``eva-fastclip <command>`` or ``python -m eva_fastclip <command>``.

Under the DeepSpeed launcher: ``deepspeed --num_gpus N --module eva_fastclip train --config FILE``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from eva_fastclip.config import ConfigError, load_config
from eva_fastclip.plan.layout import batch_layout


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging()
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"eva-fastclip {args.command}: error: {err}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eva-fastclip", description=__doc__.splitlines()[0])
    # the deepspeed launcher passes --local_rank=N before the command; LOCAL_RANK carries the same value
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "train", help="train a CLIP model (run under the deepspeed launcher for several ranks)"
    )
    _add_config_args(p)
    p.add_argument(
        "--resume", default=None, help="'latest' (newest complete checkpoint) or a checkpoint folder"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run every check before step 1 (configs, paths, lengths), print the result and the batch "
        "layout, then exit (2 if a check failed)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks to validate for with --dry-run (default: WORLD_SIZE from the launcher, else 1)",
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "tune",
        help="find the fastest layout of the config's global batch that fits the GPUs (micro-batch, "
        "checkpointing, ZeRO stage, contrastive batch, loader workers); launch it like train",
    )
    _add_config_args(p)
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
        "--estimate-only",
        action="store_true",
        help="plan for other GPUs from the memory model alone (with --gpus and --gpu-memory-gib)",
    )
    p.add_argument("--gpus", type=int, default=None, help="ranks of the planned run (--estimate-only)")
    p.add_argument(
        "--gpu-memory-gib", type=float, default=None, help="memory of each planned GPU (--estimate-only)"
    )
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser(
        "eval",
        help="zero-shot evaluation of a checkpoint folder or an exported model: the eval.* sets, or a suite "
        "(under a launcher, every rank evaluates its share)",
    )
    _add_config_args(p)
    p.add_argument(
        "--checkpoint", required=True, help="checkpoint folder (step_XXXXXXXX), exported .pt file or folder"
    )
    p.add_argument(
        "--suite",
        choices=["datacomp"],
        default=None,
        help="datacomp: DataComp's 38 tasks (FastCLIP's benchmark), those whose clip_benchmark folders exist "
        "under --datasets-root (default: the eval.* sets of the config)",
    )
    p.add_argument(
        "--datasets-root",
        default=None,
        help="with --suite: the folder DataComp's download_evalsets.py fills (wds_* folders, hf_cache)",
    )
    p.add_argument(
        "--precision",
        choices=["fp32", "datacomp"],
        default="fp32",
        help="with --suite: fp32 throughout, or datacomp: fp16 autocast where DataComp uses it on a GPU "
        "(classifier prompts, retrieval, WinoGAViL), which reproduces its published numbers (default fp32)",
    )
    p.add_argument(
        "--output",
        default=None,
        help="JSON file for the results (default with --suite: CHECKPOINT.SUITE.json)",
    )
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export", help="write an fp32 open_clip state dict or model folder from a checkpoint")
    p.add_argument("--checkpoint", required=True, help="a complete checkpoint folder, e.g. .../step_00000500")
    p.add_argument(
        "--output",
        required=True,
        help="a .pt/.pth file: the state dict; any other path: open_clip's own folder "
        "(open_clip_config.json, open_clip_model.safetensors) that open_clip loads as local-dir:PATH "
        "without eva_fastclip",
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("make-shards", help="turn a folder of images and a CSV/JSONL of captions into shards")
    p.add_argument("--images", required=True, help="folder the captions file's image paths are relative to")
    p.add_argument("--captions", required=True, help="CSV (with header) or JSONL file")
    p.add_argument("--output", required=True, help="output folder for shard-*.tar and manifest.json")
    p.add_argument("--samples-per-shard", type=int, default=10000)
    p.add_argument("--start-index", type=int, default=0, help="dataset index of the first row")
    p.add_argument("--image-column", default="image")
    p.add_argument("--caption-column", default="caption")
    p.set_defaults(func=cmd_make_shards)

    p = sub.add_parser("toy-data", help="write the embedded default dataset (procedurally drawn scenes)")
    p.add_argument("--output", default="data/toy")
    p.add_argument("--num-train", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_toy_data)

    p = sub.add_parser(
        "bench-speed", help="time our training step against OpenCLIP's, with and without 50%% masking"
    )
    p.add_argument("--model", default="ViT-B-16", help="open_clip architecture for both contestants")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="timed rounds (one step of each contestant each)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contestant first")
    p.add_argument("--deepspeed-config", default="ds_configs/zero1_bf16_lamb.json", help="our engine's JSON")
    p.add_argument("--output", default=None, help="JSON file for all step times (default: runs/bench/)")
    p.add_argument(
        "--accumulate",
        type=int,
        default=None,
        metavar="A",
        help="instead: the global batch --batch-size in A micro-batches, micro and global contrastive batch "
        "against one micro-batch and OpenCLIP's --accum-freq A step (time and peak memory)",
    )
    p.set_defaults(func=cmd_bench_speed)

    p = sub.add_parser(
        "bench-loss",
        help="loss-step peak memory and collective bytes: ours against OpenCLIP's ClipLoss, over B and ranks",
    )
    p.add_argument("--quick", action="store_true", help="a small grid (K 1-2, B 256-512)")
    p.add_argument("--dim", type=int, default=512, help="embedding width")
    p.add_argument("--output", default="runs/bench/loss_memory.json", help="JSON file for all results")
    p.set_defaults(func=cmd_bench_loss)

    p = sub.add_parser(
        "bench-lamb",
        help="LAMB optimizer step time: trust ratio per tensor against per ZeRO partition (and FusedLamb)",
    )
    p.add_argument("--width", type=int, default=768, help="ViT width of the parameter set (ViT-B/16: 768)")
    p.add_argument("--layers", type=int, default=12, help="ViT blocks of the parameter set")
    p.add_argument("--rounds", type=int, default=7, help="timed steps of each contestant, alternating")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda where present)")
    p.add_argument("--output", default="runs/bench/lamb_step.json", help="JSON file for all step times")
    p.set_defaults(func=cmd_bench_lamb)

    p = sub.add_parser(
        "bench-convergence",
        help="every loss trains one small CLIP on real openclipart pairs: held-out R@1 and zero-shot curves",
    )
    p.add_argument("--output", default="runs/bench/convergence", help="results, runs, report.md, curves.png")
    p.add_argument("--data", default="data/openclipart", help="converted drawings (made first if missing)")
    p.add_argument("--openclipart-root", default="/usr/share/openclipart/png", help="openclipart-png's PNGs")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256], help="global batch sizes")
    p.add_argument(
        "--accumulate",
        type=int,
        nargs="+",
        default=[1],
        metavar="A",
        help="micro-batches per step: 1 (one micro-batch of the batch), or A > 1 in every mode of "
        "--contrastive-batches (e.g. --accumulate 1 4)",
    )
    p.add_argument(
        "--contrastive-batches",
        nargs="+",
        default=["micro", "global"],
        choices=["micro", "global"],
        help="train.contrastive_batch of the accumulated runs",
    )
    p.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="openclip fastclip_v1 fastclip_v3 fastclip_v3_exact sogclr isogclr (default: all)",
    )
    p.add_argument("--jobs", type=int, default=2, help="runs at a time, each on cores/jobs torch threads")
    p.add_argument("--model", default="bench-vit-xs", help="open_clip architecture of every run")
    p.add_argument("--image-size", type=int, default=32, help="pixels of the converted drawings")
    p.add_argument("--eval-every-epochs", type=int, default=2)
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.set_defaults(func=cmd_bench_convergence)

    p = sub.add_parser(
        "bench-data",
        help="training loader throughput: ours against OpenCLIP's webdataset loader on the same real photos",
    )
    p.add_argument("--data", default="data/bench_loader", help="benchmark shards (written first if missing)")
    p.add_argument("--output", default="runs/bench/data", help="data_loader.json and data_loader.md")
    p.add_argument("--shards", type=int, default=6, help="shards per kind (256px, original)")
    p.add_argument("--per-shard", type=int, default=1000, help="samples per shard")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, nargs="+", default=[1], help="DataLoader workers of both loaders")
    p.add_argument("--repeats", type=int, default=3, help="runs of each loader, alternating; medians")
    p.add_argument("--warmup", type=int, default=5, help="batches read before the timed window")
    p.add_argument("--batches", type=int, default=None, help="timed batches (default: the rest of the epoch)")
    p.add_argument("--kinds", nargs="+", default=["256px", "original"], help="shard kinds to read")
    p.add_argument(
        "--model", default="ViT-B-16", help="open_clip model whose transform and tokenizer both use"
    )
    p.add_argument("--shuffle-buffer", type=int, default=1000, help="ours (OpenCLIP's is fixed: 5000)")
    p.add_argument(
        "--device",
        default=None,
        help="also make every batch the model's input on this device (cuda, or cpu), and time ours with "
        "the JPEGs decoded there (data.image_decode=gpu); default: the loaders alone",
    )
    p.add_argument("--quick", action="store_true", help="tiny shards, one run each (a smoke test)")
    p.set_defaults(func=cmd_bench_data)

    p = sub.add_parser(
        "openclipart-data", help="convert Debian's openclipart-png drawings into train/val/zero-shot shards"
    )
    p.add_argument("--output", default="data/openclipart")
    p.add_argument("--root", default="/usr/share/openclipart/png", help="where openclipart-png put its PNGs")
    p.add_argument("--image-size", type=int, default=32)
    p.set_defaults(func=cmd_openclipart_data)
    return parser


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="experiment config JSON (see configs/)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.batch_size=32 (repeatable)",
    )


def cmd_train(args) -> int:
    from eva_fastclip.plan import preflight
    from eva_fastclip.plan.deepspeed_json import (
        load_deepspeed_config,
        resolve_deepspeed_config,
        resolve_precision,
    )
    from eva_fastclip.plan.precision import detect_hardware

    cfg = load_config(args.config, args.overrides)
    ds = load_deepspeed_config(cfg.train.deepspeed_config)
    world_size = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    layout = batch_layout(cfg, world_size)
    # validated here, before any process group starts
    precision = resolve_precision(cfg, ds, source=cfg.train.deepspeed_config, hardware=detect_hardware())
    resolved = resolve_deepspeed_config(
        ds, cfg, layout, source=cfg.train.deepspeed_config, precision=precision
    )
    # every path the run reads or writes, and its lengths: checked before any process group starts
    report = preflight.check_run(cfg, world_size, resume=args.resume)
    if args.dry_run:
        summary = {
            "world_size": world_size,
            "global_batch": layout.global_batch,
            # what the run's start-up log states: share per rank, micro-batch, accumulation, contrastive batch
            "batch": {**layout.summary(), "derived_from": layout.source, "warnings": layout.warnings()},
            "data": preflight.sizes_dict(report),
            "preflight": report.to_dict(),
            "precision": {"name": precision.name, "reason": precision.reason, "warning": precision.warning},
            "experiment": cfg.to_dict(),
            "deepspeed": resolved,
        }
        print(json.dumps(summary, indent=2))
    preflight.raise_for_errors(report.problems, log_warnings=False)  # the Trainer logs the warnings
    if args.dry_run:
        return 0
    from eva_fastclip.checkpointing.checkpoint import CheckpointWriteError
    from eva_fastclip.engine.trainer import NonFiniteSteps, Trainer
    from eva_fastclip.reliability.preemption import PREEMPTED_EXIT_CODE, Preempted, outlive_closed_output
    from eva_fastclip.reliability.watchdog import Watchdog

    flight_recorder = Path(cfg.train.output_dir) / "flight_recorder"
    outlive_closed_output()  # a stop on several nodes closes the output first (reliability/preemption.py)
    try:
        with Watchdog(
            cfg.train.hang_timeout_s, cfg.train.hang_timeout_long_s, dump_dir=flight_recorder
        ) as dog:
            Trainer(cfg, ds, resume=args.resume, watchdog=dog).train()
    except NonFiniteSteps as err:  # the last complete checkpoint is intact: say which, exit non-zero
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"eva-fastclip train: stopped: {err}", file=sys.stderr)
        return 3
    except Preempted as err:  # saved at a step boundary: resumable, not a failure
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"eva-fastclip train: preempted: {err}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    except CheckpointWriteError as err:  # nothing of it left behind; the last complete one is intact
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"eva-fastclip train: stopped: {err}", file=sys.stderr)
        return 4
    return 0


def cmd_tune(args) -> int:
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
    )
    if opts.estimate_only:
        Tuner(cfg, raw, ds, opts).run()
        return 0
    try:
        with Watchdog(cfg.train.hang_timeout_s, cfg.train.hang_timeout_long_s) as dog:
            Tuner(cfg, raw, ds, opts, watchdog=dog).run()
    except DeviceUnusable as err:
        print(f"eva-fastclip tune: stopped: {err}", file=sys.stderr)
        return 5
    return 0


def cmd_eval(args) -> int:
    import torch
    from open_clip.constants import HF_SAFE_WEIGHTS_NAME

    from eva_fastclip.engine.evaluate import evaluate_model, format_results
    from eva_fastclip.evaluation import evaluate_datacomp, format_datacomp
    from eva_fastclip.export import consolidated_state_dict
    from eva_fastclip.losses import Gatherer
    from eva_fastclip.models import create_model

    if args.suite and not args.datasets_root:
        raise ValueError(
            f"--suite {args.suite} needs --datasets-root DIR (a folder of clip_benchmark wds_* folders)"
        )
    if args.precision != "fp32" and not args.suite:
        raise ValueError("--precision applies to --suite; the eval.* sets run in fp32")
    cfg = load_config(args.config, args.overrides)
    bundle = create_model(cfg.model)
    path = Path(args.checkpoint)
    if (path / HF_SAFE_WEIGHTS_NAME).is_file():  # an exported open_clip folder
        import safetensors.torch

        state_dict = safetensors.torch.load_file(path / HF_SAFE_WEIGHTS_NAME)
    elif path.is_dir():
        state_dict = consolidated_state_dict(path)
    else:
        state_dict = torch.load(path, map_location="cpu")
    if "logit_scale" in state_dict:
        state_dict["logit_scale"] = state_dict["logit_scale"].reshape(bundle.model.logit_scale.shape)
    bundle.model.load_state_dict(state_dict, strict=True)
    device = _join_eval_ranks()
    model, collectives = bundle.model.to(device), Gatherer.from_process_group()
    is_main = collectives.rank == 0
    if args.suite == "datacomp":
        results = evaluate_datacomp(
            model,
            tokenize=bundle.tokenizer,
            preprocess=bundle.preprocess_eval,
            datasets_root=args.datasets_root,
            batch_size=cfg.eval.batch_size,
            device=device,
            precision=args.precision,
            workers=cfg.eval.workers,
            collectives=collectives,
            progress=is_main,
        )
        text, output = format_datacomp(results), args.output or f"{path}.{args.suite}.json"
    else:
        results = evaluate_model(
            model,
            bundle,
            cfg.eval,
            device=device,
            dtype=torch.float32,
            collectives=collectives,
            progress=is_main,
        )
        text, output = format_results(results), args.output
    if is_main:
        print(text)
        if output:
            Path(output).parent.mkdir(parents=True, exist_ok=True)
            Path(output).write_text(json.dumps({"checkpoint": str(path), **results}, indent=2))
            print(f"results: {output}")
    return 0


def _join_eval_ranks():
    """Under a launcher (WORLD_SIZE > 1) join the process group, so each rank evaluates its share; the
    device: this rank's GPU, else the CPU."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if cuda else "gloo")
    return torch.device(f"cuda:{local_rank}" if cuda else "cpu")


def cmd_export(args) -> int:
    from eva_fastclip.export import export_open_clip

    print(json.dumps(export_open_clip(Path(args.checkpoint), Path(args.output)), indent=2))
    return 0


def cmd_make_shards(args) -> int:
    from eva_fastclip.data import write_shards

    manifest = write_shards(
        args.images,
        args.captions,
        args.output,
        samples_per_shard=args.samples_per_shard,
        start_index=args.start_index,
        image_column=args.image_column,
        caption_column=args.caption_column,
    )
    summary = {k: manifest[k] for k in ("num_samples", "index_min", "index_max", "skipped")}
    print(json.dumps({"output": args.output, **summary}, indent=2))
    return 0


def cmd_toy_data(args) -> int:
    from eva_fastclip.data import write_toy_dataset

    summary = write_toy_dataset(args.output, num_train=args.num_train, seed=args.seed)
    print(json.dumps(summary, indent=2, default=str))
    return 0


def cmd_bench_speed(args) -> int:
    from benchmarks.speed import format_report, run_speed_benchmark

    if args.accumulate is not None:
        from benchmarks.accumulation import format_accumulation_report, run_accumulation_benchmark

        results = run_accumulation_benchmark(
            model=args.model,
            global_batch=args.batch_size,
            accum=args.accumulate,
            steps=args.steps,
            warmup=args.warmup,
            ds_config=args.deepspeed_config,
            output=args.output or "runs/bench/accumulation.json",
        )
        print(format_accumulation_report(results), flush=True)
        print(f"full results: {results['output']}", flush=True)
        return 0
    results = run_speed_benchmark(
        model=args.model,
        batch_size=args.batch_size,
        steps=args.steps,
        warmup=args.warmup,
        ds_config=args.deepspeed_config,
        output=args.output or "runs/bench/speed.json",
    )
    print(format_report(results), flush=True)
    print(f"full results: {results['output']}", flush=True)
    return 0


def cmd_bench_loss(args) -> int:
    from benchmarks import loss_memory

    argv = ["--dim", str(args.dim), "--output", args.output] + (["--quick"] if args.quick else [])
    return loss_memory.main(argv)


def cmd_bench_lamb(args) -> int:
    from benchmarks.lamb_step import format_lamb_report, run_lamb_benchmark

    results = run_lamb_benchmark(
        width=args.width, layers=args.layers, rounds=args.rounds, device=args.device, output=args.output
    )
    print(format_lamb_report(results), flush=True)
    print(f"full results: {results['output']}", flush=True)
    return 0


def cmd_bench_convergence(args) -> int:
    import shlex

    from benchmarks.convergence import run_convergence_benchmark

    result = run_convergence_benchmark(
        output=Path(args.output),
        data=Path(args.data),
        openclipart_root=Path(args.openclipart_root),
        variants=args.variants,
        batches=tuple(args.batches),
        seeds=tuple(args.seeds),
        layouts=tuple(
            (a, mode) for a in args.accumulate for mode in (["micro"] if a == 1 else args.contrastive_batches)
        ),
        epochs=args.epochs,
        model=args.model,
        image_size=args.image_size,
        eval_every_epochs=args.eval_every_epochs,
        warmup_epochs=args.warmup_epochs,
        jobs=args.jobs,
        command=shlex.join(["eva-fastclip", *sys.argv[1:]]),
    )
    print(json.dumps(result, indent=2), flush=True)
    return 0


def cmd_bench_data(args) -> int:
    import shlex

    from benchmarks.data_loader import format_data_report, run_data_benchmark

    sizes = dict(
        shards=args.shards, per_shard=args.per_shard, batch_size=args.batch_size, repeats=args.repeats
    )
    if args.quick:  # its own shard and output folders: the full-size shards and results stay
        sizes = dict(shards=2, per_shard=48, batch_size=8, repeats=1)
    results = run_data_benchmark(
        data=Path(args.data) / "quick" if args.quick else args.data,
        output=Path(args.output) / "quick" if args.quick else args.output,
        workers=args.workers,
        warmup=2 if args.quick else args.warmup,
        batches=args.batches,
        kinds=args.kinds,
        model=args.model,
        floor_samples=20 if args.quick else 500,
        shuffle_buffer=args.shuffle_buffer,
        device=args.device,
        command=shlex.join(["eva-fastclip", *sys.argv[1:]]),
        **sizes,
    )
    print(format_data_report(results), flush=True)
    print(f"full results: {results['output']}/data_loader.json", flush=True)
    return 0


def cmd_openclipart_data(args) -> int:
    from eva_fastclip.data.openclipart import write_openclipart_dataset

    summary = write_openclipart_dataset(args.output, root=args.root, image_size=args.image_size)
    print(json.dumps({"output": args.output, **summary}, indent=2))
    return 0


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
