"""Training layouts side by side: a preset's own layout against the one `eva-fastclip tune` chose.

    deepspeed --num_gpus 2 --module benchmarks.tune_layouts \\
        --layout preset=configs/toy.json --layout tuned=tuned.json [--set key=value ...] \\
        [--rounds 3] [--steps 4] [--output runs/bench/tune_layouts.json]

Each ``--layout NAME=CONFIG`` is trained as its config says (its micro-batch, accumulation, contrastive
batch, checkpointing and its DeepSpeed JSON's ZeRO stage; ``--set`` applies to all of them), by tune's
own probe (tune/probe.py): the real Trainer and engine, 1 untimed + ``--steps`` timed optimizer steps on
synthetic batches. The layouts take turns, ``--rounds`` times, the first one rotating, so a slow phase of
the machine hits all alike. Reported: each one's median samples per second over its rounds, its peak
memory (as tune measures it), and its speed over the first layout's. Every layout must have the same
global batch: the comparison is of layouts of one recipe.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from eva_fastclip.config import ConfigError, load_config
from eva_fastclip.plan.deepspeed_json import load_deepspeed_config
from eva_fastclip.plan.precision import detect_hardware
from eva_fastclip.plan.run_plan import make_plan
from eva_fastclip.tune.layouts import Candidate
from eva_fastclip.tune.memory_model import GIB
from eva_fastclip.tune.probe import model_probe


def _candidate(cfg, ds, world: int) -> Candidate:
    """The layout the run plan makes of ``cfg`` on ``world`` ranks, as tune's candidate."""
    layout = make_plan(cfg, ds, world_size=world, hardware=detect_hardware(), inputs=False).layout
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    return Candidate(
        layout.micro_batch,
        layout.grad_accum_steps,
        layout.contrastive,
        cfg.model.grad_checkpointing,
        stage,
        world,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--layout", action="append", required=True, metavar="NAME=CONFIG")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps of each turn")
    parser.add_argument("--output", default="runs/bench/tune_layouts.json")
    args = parser.parse_args(argv)
    from eva_fastclip.reliability.process import init_process_group

    rank, world, _ = init_process_group()
    import open_clip

    layouts = {}
    for item in args.layout:
        name, _, path = item.partition("=")
        cfg = load_config(path, args.overrides)
        ds = load_deepspeed_config(cfg.train.deepspeed_config)
        layouts[name] = (cfg, ds, _candidate(cfg, ds, world))
    batches = {c.global_batch for _, _, c in layouts.values()}
    if len(batches) != 1:
        raise ConfigError(f"the layouts train different global batches {sorted(batches)}: compare one recipe")
    names = list(layouts)
    results: dict[str, dict] = {name: {"step_s": [], "peak": []} for name in names}
    out = Path(args.output)
    for round_ in range(args.rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            cfg, ds, candidate = layouts[name]
            model = open_clip.get_model_config(cfg.model.name)
            size = model["vision_cfg"]["image_size"]
            result = model_probe(
                cfg,
                ds,
                candidate,
                image_shape=(3, size, size),
                context_length=model["text_cfg"].get("context_length", 77),
                output_dir=str(out.with_suffix(".work")),
                limit=None,
                steps=args.steps,
            )
            results[name]["step_s"].append(result.step_s)
            results[name]["peak"].append(result.peak)
            if rank == 0:
                step = f"{result.step_s:.3f} s a step"
                print(f"round {round_ + 1} {name}: {candidate.name()} {step}", flush=True)
    if rank != 0:
        return 0
    rows = []
    for name in names:
        candidate = layouts[name][2]
        step_s = statistics.median(results[name]["step_s"])
        rows.append(
            {
                "layout": name,
                "config": dict(item.partition("=")[::2] for item in args.layout)[name],
                "candidate": candidate.name(),
                "samples_per_s": candidate.global_batch / step_s,
                "step_s": results[name]["step_s"],
                "peak_gib": max(results[name]["peak"]) / GIB,
            }
        )
    base = rows[0]["samples_per_s"]
    lines = ["| layout | micro-batch x accumulation, contrastive, checkpointing, ZeRO | samples/s | "
             f"over {rows[0]['layout']} | peak GiB |", "|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        row["ratio"] = row["samples_per_s"] / base
        lines.append(
            f"| {row['layout']} | {row['candidate']} | {row['samples_per_s']:.1f} | {row['ratio']:.2f} | "
            f"{row['peak_gib']:.3f} |"
        )
    print("\n".join(lines))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"ranks": world, "rounds": args.rounds, "rows": rows}, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
