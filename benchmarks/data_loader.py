"""Training loader throughput: ours against OpenCLIP's own webdataset loader, on the same shards, with the
same transform, batch and worker count, side by side in one run; and the decode-only floor that any loader
pays.

    python -m benchmarks.data_loader [--workers 1 2] [--batches 40] [--quick] [--device cuda]

(On your own shards, ours alone: ``eva-fastclip loader-speed --config CONFIG``.)

- **Shards**: real photographs, offline, in img2dataset's layout, written once under ``--data`` and
  reused (benchmarks/data_shards.py).
- **openclip**: ``open_clip_train.data.get_wds_dataset``, its real code. Two pieces are patched so that it
  runs here, nothing else: (1) its ``group_by_keys_nothrow`` reads ``filesample["fname"]`` from every item
  and so raises ``KeyError: 'fname'`` on the empty end-of-shard marker (``{}``) that webdataset 1.0's
  ``tar_file_expander`` yields after each shard; for the run it is replaced by webdataset's own
  ``tariterators.group_by_keys`` (the same grouping; it ends a sample at the marker and, on a duplicate
  member, hands the error to OpenCLIP's ``log_and_continue``; our shards have none). (2) Where pandas is not
  installed, ``open_clip_train.data`` is imported with a placeholder for it: only its CSV dataset uses it.
  (benchmarks/data_contestants.py)
- **ours**: :class:`eva_fastclip.data.TrainLoader`, ``needs_index=False``, whatever it yields (the table
  gives the image dtype and bytes per batch: uint8 images are normalised on the device in training, which
  is not loader CPU).
- **floor**: one process, the JPEG bytes already in memory, decode only (PIL to RGB, and
  ``torchvision.io.decode_jpeg``), no crop; and each stage's CPU time per sample (benchmarks/data_floor.py).

Both loaders get the model's open_clip training transform (built from its config, as
``create_model_and_transforms`` builds it, without building the model: see
``data_contestants.training_transform``) and its tokenizer. Each run reads one epoch: the first ``warmup``
batches (worker start, the shuffle buffer filling) are not timed, then ``batches`` batches are, measured as
:mod:`eva_fastclip.data.throughput` measures (samples per second of wall time and per CPU-second of the main
process and every worker, from ``/proc``; the workers' peak RSS and private memory). The runs of the two
loaders alternate (ABAB, then BABA), and the report gives the rates' medians over ``repeats`` and the memory
of the worst run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import logging
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from benchmarks.command_line import run_main
from benchmarks.data_contestants import openclip_batches, openclip_patched, our_batches, training_transform
from benchmarks.data_floor import STAGES, decode_floor, stage_times
from benchmarks.data_remote import OPENCLIP_PIPE, OURS_S3, remote_servers, remote_table, remote_urls
from benchmarks.data_shards import KINDS, bench_shards
from eva_fastclip.data.throughput import descendants, measure, on_device, wait_for_workers_to_exit
from eva_fastclip.data.workers import start_worker_server
from eva_fastclip.plan.precision import cpu_model

logger = logging.getLogger(__name__)
#: with --device: ours again, the workers handing JPEG bytes for the device to decode (data.image_decode=gpu)
DEVICE_DECODE = "ours_device_decode"
#: what the benchmark changes in OpenCLIP's loader (data_contestants.openclip_patched), for the report
OPENCLIP_PATCHED = "open_clip_train.data.group_by_keys_nothrow := webdataset.tariterators.group_by_keys"


def run_data_benchmark(
    data: str | Path = "data/bench_loader",
    output: str | Path = "runs/bench/data",
    *,
    shards: int = 6,
    per_shard: int = 1000,
    batch_size: int = 64,
    workers: Iterable[int] = (1,),
    repeats: int = 3,
    warmup: int = 5,
    batches: int | None = None,
    kinds: Iterable[str] = KINDS,
    model: str = "ViT-B-16",
    floor_samples: int = 500,
    shuffle_buffer: int = 1000,
    seed: int = 0,
    device: str | None = None,
    remote: bool = False,
    command: str | None = None,
) -> dict[str, Any]:
    """Every (shard kind, worker count): ``repeats`` runs of each loader, alternating, and the decode
    floor; the results are written under ``output`` (``data_loader.json``, ``data_loader.md``).

    With ``device`` every batch is also made into the model's input there, as the trainer makes it, and
    a third loader runs: ours with the JPEGs decoded on ``device`` (``data.image_decode=gpu``). With
    ``remote`` both loaders also read the shards from servers on the loopback (benchmarks/data_remote.py)."""
    import open_clip

    target = _check_device(device)
    workers, kinds = list(workers), list(kinds)
    timed = _timed_batches(shards, per_shard, batch_size, workers, warmup, batches, kinds)
    paths = bench_shards(data, shards, per_shard, seed)
    preprocess = training_transform(model)
    tokenizer = open_clip.get_tokenizer(model)
    loaders = _contestants(shuffle_buffer, target, remote)
    with remote_servers(Path(data), kinds) if remote else contextlib.nullcontext() as servers:
        urls = remote_urls(paths, Path(data), servers) if remote else {}
        start_worker_server()  # our workers' fork server, once: among the processes each run leaves out
        common = (preprocess, tokenizer, batch_size)
        runs = []
        for kind in kinds:
            for w in workers:
                for repeat in range(repeats):
                    for name in loaders if repeat % 2 == 0 else list(loaders)[::-1]:
                        make = _maker(loaders, name, kind, paths, urls, common, w, seed)
                        where = dict(kind=kind, loader=name, workers=w, repeat=repeat)
                        runs.append(_one_run(make, target, warmup, timed[w], **where))
    # after every loader run: the bytes it reads would otherwise stay in the heap that workers fork from
    floor = {
        kind: _floor(paths[kind][0], floor_samples, repeats, preprocess, tokenizer, batch_size)
        for kind in kinds
    }
    settings = dict(model=model, batch_size=batch_size, workers=workers, repeats=repeats,
                    warmup_batches=warmup, shards=shards, per_shard=per_shard, data=str(data),
                    device=None if target is None else str(target), remote=remote)  # fmt: skip
    results = _record(command, settings, shuffle_buffer, runs, floor)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data_loader.json").write_text(json.dumps(results, indent=2))
    (out / "data_loader.md").write_text(format_data_report(results) + "\n")
    return {**results, "output": str(out)}


def _record(command, settings: dict, shuffle_buffer: int, runs: list, floor: dict) -> dict[str, Any]:
    return {
        "what": "training loader throughput: ours (TrainLoader) against OpenCLIP's get_wds_dataset",
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
        "versions": _versions(),
        "settings": settings,
        "shuffle_buffer": {
            "ours": f"{shuffle_buffer} samples per worker (data.shuffle_buffer), encoded bytes",
            "openclip": "5000 samples per worker (1000 before the first), encoded bytes; shards: 2000",
        },
        "openclip_patched": OPENCLIP_PATCHED,
        "runs": runs,
        "summary": _summary(runs),
        "floor": floor,
    }


def _maker(loaders, name: str, kind: str, paths, urls, common: tuple, workers: int, seed: int):
    """What builds loader ``name`` over the ``kind`` shards (their URLs on its server, if it reads one)."""
    loader = loaders[name]
    if name == OPENCLIP_PIPE:  # its --train-num-samples from the local copies' records
        loader = functools.partial(loader, local=paths[kind])
    sources = urls[name][kind] if name in urls else paths[kind]
    return functools.partial(loader, sources, *common, workers, seed)


def _timed_batches(
    shards: int, per_shard: int, batch_size: int, workers: list[int], warmup: int, batches, kinds
) -> dict[int, int]:
    """workers -> the batches to time, both loaders holding them after the warm-up; ValueError, before any
    work, for settings that do not fit."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown shard kinds {unknown} (--kinds): choose from {list(KINDS)}")
    if any(w < 1 for w in workers) or any(shards % w for w in workers):
        raise ValueError(
            f"--workers {workers} must each be >= 1 and divide --shards {shards}: OpenCLIP gives each worker "
            "whole shards, and uneven shares would leave one worker idle at the end of its epoch"
        )
    timed = {}
    for w in workers:
        whole = w * (shards // w * per_shard // batch_size)  # full batches of w workers' equal shares
        timed[w] = batches or whole - warmup - 2 * w  # the default leaves each worker two to spare
        if warmup < 1 or timed[w] < 1 or warmup + timed[w] > whole:
            raise ValueError(
                f"--warmup {warmup} and --batches {timed[w]} must be >= 1 and fit in the {whole} full "
                f"batches of {batch_size} that {w} worker(s) read from {shards} x {per_shard} samples: "
                "change --warmup/--batches, or raise --shards/--per-shard"
            )
    return timed


def _contestants(shuffle_buffer: int, target: torch.device | None, remote: bool) -> dict[str, Any]:
    """Loader name -> the function that builds it (urls, preprocess, tokenizer, batch, workers, seed)."""
    pin = target is not None and target.type == "cuda"  # as the trainer pins for a GPU
    loaders = {
        "ours": functools.partial(our_batches, shuffle_buffer=shuffle_buffer, pin_memory=pin),
        "openclip": openclip_batches,
    }
    if remote:
        loaders[OURS_S3] = loaders["ours"]
        loaders[OPENCLIP_PIPE] = openclip_batches
    if target is not None:
        loaders[DEVICE_DECODE] = functools.partial(
            our_batches, shuffle_buffer=shuffle_buffer, decode_device=target, pin_memory=pin
        )
    return loaders


def _one_run(make, target, warmup: int, timed: int, **where) -> dict[str, Any]:
    """One measured run of a loader (``where``: its kind, loader, workers and repeat), its workers gone
    before it returns."""
    others = set(descendants())  # e.g. multiprocessing's resource tracker
    openclip = where["loader"] in ("openclip", OPENCLIP_PIPE)
    with openclip_patched() if openclip else contextlib.nullcontext():
        loader, _ = make()
        batches = loader if target is None else on_device(loader, target)
        result = measure(batches, warmup, timed, workers=where["workers"])
        del batches
    del loader  # a persistent DataLoader (OpenCLIP's) keeps its workers while it lives
    wait_for_workers_to_exit(others)
    logger.info(
        "%s, %d worker(s), %s, run %d: %.1f samples/s, %.1f samples/CPU-s, worker peak RSS %.0f MiB, "
        "private %.0f MiB", where["kind"], where["workers"], where["loader"], where["repeat"],
        result["samples_per_s"], result["samples_per_cpu_s"], result["worker_peak_rss_mib"],
        result["worker_peak_private_mib"],
    )  # fmt: skip
    return {**result, **where}


def _floor(url: str, samples: int, repeats: int, preprocess, tokenizer, batch_size: int) -> dict[str, Any]:
    """The decode-only floor of a shard kind (medians of ``repeats`` runs) and its stages' times."""
    runs = [decode_floor(url, samples) for _ in range(repeats)]
    floor: dict[str, Any] = {"runs": runs}
    floor.update(_floor_summary(runs))
    floor["stages_ms"] = stage_times(url, samples, preprocess, tokenizer, batch_size)
    return floor


def _check_device(device: str | None) -> torch.device | None:
    """``--device`` as a torch device; ValueError, before any work, for one this machine does not have."""
    if device is None:
        return None
    try:
        target = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"--device {device!r}: {err}") from None
    if target.type not in ("cuda", "cpu"):
        raise ValueError(
            f"--device {device}: cuda or cpu (cpu runs the device path on the CPU, as the tests do)"
        )
    if target.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise ValueError(
                f"--device {device}: torch sees no CUDA GPU here (without --device: the loaders alone)"
            )
        if target.index is not None and target.index >= count:
            raise ValueError(f"--device {device}: torch sees {count} GPU(s), cuda:0 to cuda:{count - 1}")
        # CUDA starts now, not in the first timed run: every loader's workers fork from the same parent
        torch.zeros(1, device=target)
    return target


def _summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (kind, workers, loader): the rates' medians, the worst run's memory; and ours / OpenCLIP."""
    rows = []
    for kind in dict.fromkeys(r["kind"] for r in runs):
        for w in dict.fromkeys(r["workers"] for r in runs if r["kind"] == kind):
            row: dict[str, Any] = {"kind": kind, "workers": w}
            for name in dict.fromkeys(r["loader"] for r in runs):
                mine = [r for r in runs if (r["kind"], r["workers"], r["loader"]) == (kind, w, name)]
                row[name] = {
                    key: statistics.median(r[key] for r in mine)
                    for key in ("samples_per_s", "samples_per_cpu_s")
                } | {
                    # memory: the worst run, a bound (the rates: medians)
                    "worker_peak_rss_mib": max(r["worker_peak_rss_mib"] for r in mine),
                    "worker_peak_private_mib": max(r["worker_peak_private_mib"] for r in mine),
                    "image_dtype": mine[0]["image_dtype"],
                    "batch_bytes": mine[0]["batch_bytes"],
                    "samples": mine[0]["samples"],
                }
            for key in ("samples_per_s", "samples_per_cpu_s"):
                row[f"ratio_{key}"] = row["ours"][key] / row["openclip"][key]
                if DEVICE_DECODE in row:
                    row[f"device_decode_ratio_{key}"] = row[DEVICE_DECODE][key] / row["openclip"][key]
            rows.append(row)
    return rows


def _floor_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "samples"}


def format_data_report(results: dict[str, Any]) -> str:
    """The results as markdown: the settings, one row per (kind, workers), the floor."""
    s = results["settings"]
    lines = [
        f"{results['what']}; {results['date']}, {results['machine']['cpu']} ({results['machine']['cores']} "
        f"cores), torch {results['versions']['torch']}, webdataset {results['versions']['webdataset']}, "
        f"open_clip {results['versions']['open_clip']}; {s['model']} transform, batch {s['batch_size']}, "
        f"{s['shards']} x {s['per_shard']} samples per shard kind; rates: medians of {s['repeats']} runs, "
        "memory: the largest"
        + (
            f"; every batch also made into float32 model input on {s['device']}, as the trainer makes it, "
            "and waited for."
            if s.get("device")
            else "; the loaders alone (normalising ours on the device is not in these figures)."
        ),
        "",
        "| shards | workers | ours samples/s | OpenCLIP samples/s | ours / OpenCLIP | ours samples/CPU-s | "
        "OpenCLIP samples/CPU-s | ours / OpenCLIP per CPU-s | ours batch | OpenCLIP batch | "
        "worker peak RSS MiB ours / OpenCLIP | worker peak private MiB ours / OpenCLIP |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["summary"]:
        ours, oc = row["ours"], row["openclip"]
        lines.append(
            f"| {row['kind']} | {row['workers']} | {ours['samples_per_s']:.0f} | {oc['samples_per_s']:.0f} | "
            f"{row['ratio_samples_per_s']:.2f} | {ours['samples_per_cpu_s']:.0f} | "
            f"{oc['samples_per_cpu_s']:.0f} | "
            f"**{row['ratio_samples_per_cpu_s']:.2f}** | {_batch(ours)} | {_batch(oc)} | "
            f"{ours['worker_peak_rss_mib']:.0f} / {oc['worker_peak_rss_mib']:.0f} | "
            f"{ours['worker_peak_private_mib']:.0f} / {oc['worker_peak_private_mib']:.0f} |"
        )
    if s.get("device"):
        lines += _device_decode_table(results["summary"], s["device"])
    if s.get("remote"):
        lines += remote_table(results["summary"])
    lines += _floor_tables(results["floor"])
    buffers = results["shuffle_buffer"]
    lines += [
        "",
        f"Shuffle buffers: ours {buffers['ours']}; OpenCLIP {buffers['openclip']}. "
        f"OpenCLIP patched: {results['openclip_patched']}.",
    ]
    return "\n".join(lines)


def _device_decode_table(summary: list[dict[str, Any]], device: str) -> list[str]:
    lines = [
        "",
        f"Ours with the JPEGs decoded on {device} (data.image_decode=gpu; the workers read the "
        "bytes and draw the crop boxes):",
        "",
        "| shards | workers | samples/s | / OpenCLIP | samples/CPU-s | / OpenCLIP per CPU-s | batch | "
        "worker peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in summary:
        d = row[DEVICE_DECODE]
        lines.append(
            f"| {row['kind']} | {row['workers']} | {d['samples_per_s']:.0f} | "
            f"{row['device_decode_ratio_samples_per_s']:.2f} | {d['samples_per_cpu_s']:.0f} | "
            f"**{row['device_decode_ratio_samples_per_cpu_s']:.2f}** | {_batch(d)} | "
            f"{d['worker_peak_rss_mib']:.0f} |"
        )
    return lines


def _floor_tables(floor: dict[str, dict[str, Any]]) -> list[str]:
    """The decode-only floor per shard kind, and the per-sample CPU time of each stage."""
    lines = [
        "",
        "Decode-only floor (one process, bytes in memory, no crop), samples per CPU-second:",
        "",
        "| shards | mean JPEG KiB | mean megapixels | PIL decode | torchvision decode_jpeg |",
        "|---|---|---|---|---|",
    ]
    for kind, f in floor.items():
        lines.append(
            f"| {kind} | {f['mean_jpeg_kib']:.0f} | {f['mean_megapixels']:.2f} | "
            f"{f['pil_samples_per_cpu_s']:.0f} | {f['torchvision_samples_per_cpu_s']:.0f} |"
        )
    kinds = [kind for kind, f in floor.items() if "stages_ms" in f]
    if not kinds:
        return lines
    lines += [
        "",
        "Per-sample CPU time by stage, ms (one process, one thread, the bytes in memory):",
        "",
        "| stage | " + " | ".join(kinds) + " |",
        "|---|" + "---|" * len(kinds),
    ]
    stages = {kind: floor[kind]["stages_ms"] for kind in kinds}
    for key, label in STAGES:
        lines.append(f"| {label} | " + " | ".join(f"{stages[k][key]:.2f}" for k in kinds) + " |")
    for who in ("openclip", "ours"):
        totals = [sum(v for key, v in stages[k].items() if key.startswith(who)) for k in kinds]
        lines.append(f"| **{who}, all stages** | " + " | ".join(f"**{t:.2f}**" for t in totals) + " |")
    return lines


def _batch(summary: dict[str, Any]) -> str:
    return f"{summary['image_dtype']}, {summary['batch_bytes'] / 2**20:.1f} MiB"


def _versions() -> dict[str, str]:
    import open_clip
    import webdataset

    return {
        "torch": torch.__version__,
        "webdataset": webdataset.__version__,
        "open_clip": open_clip.__version__,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.data_loader",
        description="training loader throughput: ours against OpenCLIP's webdataset loader on the same real "
        "photos",
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
    p.add_argument(
        "--remote",
        action="store_true",
        help="also read the shards from loopback servers: ours from moto's S3 server, OpenCLIP's through "
        "pipe:curl from an HTTP server (needs the dev extra: moto[server], s3fs)",
    )
    p.add_argument("--quick", action="store_true", help="tiny shards, one run each (a smoke test)")
    return p


def main(argv: list[str] | None = None) -> int:
    command = ["python", "-m", "benchmarks.data_loader", *(sys.argv[1:] if argv is None else argv)]

    def run(args) -> int:
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
            remote=args.remote,
            command=shlex.join(command),
            **sizes,
        )
        print(format_data_report(results), flush=True)
        print(f"full results: {results['output']}/data_loader.json", flush=True)
        return 0

    return run_main(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
