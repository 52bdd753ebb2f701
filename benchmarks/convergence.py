"""Convergence on real images: every loss trains the same small CLIP on the same openclipart pairs.

    python -m benchmarks.convergence [--variants ...] [--batches 64 256] [--seeds 0 1 2] [--epochs 30]

Each run is one (loss variant, global batch, seed) through the real ``Trainer`` (one rank, fp32, AdamW),
in its own process, evaluated every few epochs on held-out drawings: image->text and text->image R@1 over
the retrieval split and zero-shot top-1 over the category split (:mod:`eva_fastclip.data.openclipart`).
Every variant sees the same data, epochs, batch, schedule and seeds; the seed fixes the model's
initialisation and the data order, so runs with the same seed are paired.

A finished run leaves ``results/<variant>-b<batch>-s<seed>.json`` (curves read from the run's TensorBoard
events, final metrics, wall time); a restarted benchmark skips those. The aggregate is ``report.md``
(tables: mean ± sample standard deviation over seeds, chance level, FastCLIP-v3's paired differences) and
``curves.png``. docs/benchmarks.md describes the recipe and the results.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import multiprocessing
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.command_line import run_main
from benchmarks.convergence_grid import DEFAULT_MODEL, VARIANTS, RunSpec, plan_runs
from benchmarks.convergence_report import format_report, plot_curves
from benchmarks.convergence_run import load_results, run_in_child
from eva_fastclip.data import openclipart

log = logging.getLogger(__name__)


def prepare_data(data_dir: Path, root: Path, image_size: int) -> dict[str, Any]:
    """The converted dataset under ``data_dir``, converted now if it is not there yet."""
    summary = openclipart.read_summary(data_dir)
    if summary is None:
        openclipart.check_installed(root)
        log.info("converting %s into %s (a few minutes, once)", root, data_dir)
        summary = openclipart.write_openclipart_dataset(data_dir, root=root, image_size=image_size)
    elif summary["image_size"] != image_size:
        raise ValueError(
            f"{data_dir} holds {summary['image_size']}-pixel images, not {image_size}: pass another --data "
            "folder, or delete it to convert again"
        )
    return summary


def run_convergence_benchmark(
    *,
    output: Path,
    data: Path,
    openclipart_root: Path = openclipart.DEFAULT_ROOT,
    variants: list[str] | None = None,
    batches: tuple[int, ...] = (64, 256),
    seeds: tuple[int, ...] = (0, 1, 2),
    layouts: tuple[tuple[int, str], ...] = ((1, "micro"),),
    epochs: int = 30,
    model: str = DEFAULT_MODEL,
    image_size: int = 32,
    eval_every_epochs: int = 2,
    warmup_epochs: int = 1,
    jobs: int = 2,
    command: str = "",
) -> dict[str, Any]:
    """Run what is missing of the grid, then write ``report.md`` and ``curves.png``; returns a summary."""
    if min(epochs, eval_every_epochs, jobs) < 1 or warmup_epochs < 0:
        raise ValueError("epochs, eval-every-epochs and jobs must be >= 1, warmup-epochs >= 0")
    summary = prepare_data(Path(data), Path(openclipart_root), image_size)
    specs = plan_runs(
        list(variants or VARIANTS),
        sorted(batches),
        list(seeds),
        list(layouts),
        epochs=epochs,
        model=model,
        eval_every_epochs=eval_every_epochs,
        warmup_epochs=warmup_epochs,
        num_train=summary["num_train"],
        image_size=image_size,
    )
    _check_configs(specs, Path(data))
    output = Path(output)
    done, todo = load_results(output, specs)
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // jobs)
    log.info(
        "%d runs: %d finished before, %d to go, %d at a time with %d torch threads each",
        len(specs),
        len(done),
        len(todo),
        jobs,
        threads,
    )
    start = time.perf_counter()
    failures = _run(todo, Path(data), output, jobs, threads, done, len(specs)) if todo else []
    elapsed = time.perf_counter() - start
    if not done:
        raise RuntimeError("no run finished: " + "; ".join(failures))
    order = {spec.name: i for i, spec in enumerate(specs)}
    done.sort(key=lambda r: order[RunSpec(**r["spec"]).name])
    title = f"openclipart ({summary['num_train']} training pairs, {image_size} px), {model}, {epochs} epochs"
    plot = plot_curves(done, output / "curves.png", title=title)
    report = format_report(done, summary, specs, command=command, elapsed=elapsed, jobs=jobs)
    (output / "report.md").write_text(report)
    if failures:
        raise RuntimeError(f"{len(failures)} runs failed (the report has the rest): " + "; ".join(failures))
    return {"report": str(output / "report.md"), "plot": str(plot), "runs": len(done), "elapsed_s": elapsed}


def _run(
    todo: list[RunSpec], data: Path, output: Path, jobs: int, threads: int, done: list, total: int
) -> list[str]:
    """The runs of ``todo``, ``jobs`` at a time, each in a process of its own; every finished run's record
    joins ``done``. Returns the failed runs' messages."""
    failures = []
    context = multiprocessing.get_context("spawn")  # a fresh process group and allocator per run
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context, max_tasks_per_child=1) as pool:
        futures = {pool.submit(run_in_child, spec, data, output, threads): spec for spec in todo}
        for future in concurrent.futures.as_completed(futures):
            spec = futures[future]
            try:
                record = future.result()
            except Exception as err:
                failures.append(str(err))
                log.error("%s", err)
                continue
            done.append(record)
            final = record["final"]
            log.info(
                "[%d/%d] %s: %.0f s, zero-shot %.3f, R@1 i->t %.3f t->i %.3f",
                len(done),
                total,
                spec.name,
                record["wall_s"],
                final["zeroshot_top1"],
                final["retrieval_image_to_text_R@1"],
                final["retrieval_text_to_image_R@1"],
            )
    return failures


def _check_configs(specs: list[RunSpec], data_dir: Path) -> None:
    """Every run's config must validate before the first one starts (a typo must not cost an hour)."""
    from eva_fastclip.config import ConfigError, load_config

    for variant in dict.fromkeys(spec.variant for spec in specs):
        spec = next(s for s in specs if s.variant == variant)
        try:
            load_config(None, spec.overrides(data_dir, Path("unused")))
        except ConfigError as err:
            raise ConfigError(f"variant {variant}: {err}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.convergence",
        description="every loss trains one small CLIP on real openclipart pairs: held-out R@1 and zero-shot "
        "curves",
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
    p.add_argument("--model", default=DEFAULT_MODEL, help="open_clip architecture of every run")
    p.add_argument("--image-size", type=int, default=32, help="pixels of the converted drawings")
    p.add_argument("--eval-every-epochs", type=int, default=2)
    p.add_argument("--warmup-epochs", type=int, default=1)
    return p


def main(argv: list[str] | None = None) -> int:
    command = ["python", "-m", "benchmarks.convergence", *(sys.argv[1:] if argv is None else argv)]

    def run(args) -> int:
        result = run_convergence_benchmark(
            output=Path(args.output),
            data=Path(args.data),
            openclipart_root=Path(args.openclipart_root),
            variants=args.variants,
            batches=tuple(args.batches),
            seeds=tuple(args.seeds),
            layouts=tuple(
                (a, mode)
                for a in args.accumulate
                for mode in (["micro"] if a == 1 else args.contrastive_batches)
            ),
            epochs=args.epochs,
            model=args.model,
            image_size=args.image_size,
            eval_every_epochs=args.eval_every_epochs,
            warmup_epochs=args.warmup_epochs,
            jobs=args.jobs,
            command=shlex.join(command),  # report.md says how to make it again
        )
        print(json.dumps(result, indent=2), flush=True)
        return 0

    return run_main(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
