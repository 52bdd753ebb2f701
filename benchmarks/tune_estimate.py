"""tune's memory model against measured peaks: estimate and probe, side by side, per model and layout.

    deepspeed --num_gpus 2 --module benchmarks.tune_estimate \\
        [--models toy-vit-t RN50 ViT-B-16] [--micro 8 16] [--output runs/bench/tune_estimate.json]

For every model, every micro-batch of ``--micro``, gradient checkpointing off and on, and ZeRO 0 and 1
(and 2 with ``--stages 0 1 2``): the estimate of tune's memory model (tune/memory_model.py: the
analytic state, DeepSpeed's bucket, the activation line traced at two sizes) and the peak that tune's probe
measures on the real engine over 1 + 3 optimizer steps (a CPU: the exact live tensor memory of
``tensor_memory.StorageTracker``; a GPU: ``torch.cuda.max_memory_allocated``). Each model trains the
``configs/toy.json`` recipe with its own architecture, the ``fastclip_v3`` loss (its per-sample table:
``--index-size`` rows) and this machine's precision. Rank 0 prints the table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from eva_fastclip.config import load_config, read_raw_config
from eva_fastclip.plan.deepspeed_json import load_deepspeed_config
from eva_fastclip.tune import TuneOptions, Tuner
from eva_fastclip.tune.memory_model import GIB

MODELS = ("toy-vit-t", "RN50", "ViT-B-16")


def measure_model(model: str, micro: list[int], stages: list[int], index_size: int, out: Path) -> list[dict]:
    overrides = [
        f"model.name={model}",
        "loss.name=fastclip_v3",
        f"data.index_size={index_size}",
        "train.batch_size=null",
        f"train.global_batch={max(micro) * 2 * _world()}",  # room for the sizes asked for
        f"train.output_dir={out / 'run'}",
    ]
    cfg = load_config("configs/toy.json", overrides)
    raw = read_raw_config("configs/toy.json", overrides)
    ds = load_deepspeed_config(cfg.train.deepspeed_config)
    tuner = Tuner(cfg, raw, ds, TuneOptions(output=out / f"{model}.json", data=False))
    start = time.perf_counter()
    tuner.prepare()
    traced_s = time.perf_counter() - start
    rows = []
    for trial in tuner.trials:
        c = trial.candidate
        if c.micro_batch not in micro or c.zero_stage not in stages or c.contrastive != "micro":
            continue
        start = time.perf_counter()
        tuner._probe(trial)
        rows.append(
            {
                "model": model,
                "micro_batch": c.micro_batch,
                "grad_accum_steps": c.grad_accum_steps,
                "grad_checkpointing": c.grad_checkpointing,
                "zero_stage": c.zero_stage,
                "ranks": c.world_size,
                "precision": tuner.precision.name,
                "est_gib": trial.est_peak / GIB,
                "peak_gib": None if trial.peak is None else trial.peak / GIB,
                "ratio": None if not trial.peak else trial.est_peak / trial.peak,
                "estimate_gib": {k: v / GIB for k, v in trial.estimate.items()},
                "probe_s": time.perf_counter() - start,
                "trace_s": traced_s,
            }
        )
    return rows


def _world() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def format_table(rows: list[dict]) -> str:
    lines = [
        "| model | ranks | precision | micro-batch | checkpointing | ZeRO | estimate GiB | measured GiB | "
        "estimate / measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        measured = "oom" if r["peak_gib"] is None else f"{r['peak_gib']:.3f}"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(
            f"| {r['model']} | {r['ranks']} | {r['precision']} | {r['micro_batch']} | "
            f"{'on' if r['grad_checkpointing'] else 'off'} | {r['zero_stage']} | {r['est_gib']:.3f} | "
            f"{measured} | {ratio} |"
        )
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    if ratios:
        worst = max(ratios, key=lambda x: abs(x - 1))
        lines.append(f"\nworst estimate / measured: {worst:.3f} (target: within 15%)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--micro", type=int, nargs="+", default=[8, 16], help="micro-batches per rank")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1], help="ZeRO stages")
    parser.add_argument("--index-size", type=int, default=1_000_000, help="per-sample table rows")
    parser.add_argument("--output", default="runs/bench/tune_estimate.json")
    args = parser.parse_args(argv)
    out = Path(args.output)
    scratch = out.with_suffix(".work")
    rows = []
    for model in args.models:
        rows += measure_model(model, sorted(args.micro), args.stages, args.index_size, scratch)
        if _rank() == 0:
            print(format_table([r for r in rows if r["model"] == model]), flush=True)
    if _rank() == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"rows": rows}, indent=2))
        print(format_table(rows))
        print(f"results: {out}")
    return 0


def _rank() -> int:
    import os

    return int(os.environ.get("RANK", "0"))


if __name__ == "__main__":
    raise SystemExit(main())
