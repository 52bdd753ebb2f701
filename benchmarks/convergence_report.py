"""The convergence benchmark's aggregate: tables of final metrics (mean ± sample standard deviation over
seeds, chance level), paired differences with a verdict from the 95% t-interval, the curves, and
``report.md``.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
from pathlib import Path
from typing import Any

from benchmarks.convergence_grid import CHANCE_KEYS, METRICS, REFERENCE, VARIANTS, RunSpec
from eva_fastclip.plan.precision import cpu_model


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for a single value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def t_quantile(df: int) -> float:
    """Two-sided 95% quantile of Student's t with ``df`` degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(0.975, df))


def _fmt(mean: float, std: float | None) -> str:
    return f"{mean:.3f}" if std is None else f"{mean:.3f} ± {std:.3f}"


Layout = tuple[int, int, str]  # (global batch, micro-batches a step, contrastive batch): a table's "batch"


def _by_cell(records: list[dict[str, Any]]) -> dict[tuple[Layout, str], dict[int, dict[str, Any]]]:
    cells: dict[tuple[Layout, str], dict[int, dict[str, Any]]] = {}
    for record in records:
        spec = record["spec"]
        layout = (spec["batch"], spec.get("accumulate", 1), spec.get("contrastive", "micro"))
        cells.setdefault((layout, spec["variant"]), {})[spec["seed"]] = record
    return cells


def _label(layout: Layout) -> str:
    batch, accumulate, contrastive = layout
    return str(batch) if accumulate == 1 else f"{batch} = {accumulate} × {batch // accumulate}, {contrastive}"


def results_table(records: list[dict[str, Any]]) -> str:
    """Final metrics per batch and variant: mean ± standard deviation over seeds, chance level last."""
    cells = _by_cell(records)
    header = ["batch", "loss", "seeds", *METRICS.values(), "final τ"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for batch in sorted({b for b, _ in cells}):
        for variant in (v for v in VARIANTS if (batch, v) in cells):
            runs = list(cells[batch, variant].values())
            row = [_label(batch), VARIANTS[variant][0], str(len(runs))]
            row += [_fmt(*mean_std([r["final"][key] for r in runs])) for key in METRICS]
            taus = [r["curves"]["temperature"][-1] for r in runs if r["curves"].get("temperature")]
            row.append(f"{statistics.fmean(taus):.3f}" if taus else "—")
            lines.append("| " + " | ".join(row) + " |")
    final = records[0]["final"]
    chance = ["", "chance level", ""] + [f"{final[CHANCE_KEYS[key]]:.3f}" for key in METRICS] + [""]
    lines.append("| " + " | ".join(chance) + " |")
    return "\n".join(lines)


def paired_differences(records: list[dict[str, Any]], reference: str = REFERENCE) -> str:
    """The reference minus each other variant, seed by seed, with a verdict from the 95% t-interval."""
    cells = _by_cell(records)
    header = ["batch", f"{VARIANTS[reference][0]} minus", "seeds"]
    header += [f"Δ {title}" for title in METRICS.values()]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for batch in sorted({b for b, _ in cells}):
        if (batch, reference) not in cells:
            continue
        ours = cells[batch, reference]
        for variant in (v for v in VARIANTS if v != reference and (batch, v) in cells):
            seeds = sorted(set(ours) & set(cells[batch, variant]))
            if not seeds:
                continue
            row = [_label(batch), VARIANTS[variant][0], str(len(seeds))]
            for key in METRICS:
                diffs = [ours[s]["final"][key] - cells[batch, variant][s]["final"][key] for s in seeds]
                row.append(f"{_fmt(*mean_std(diffs))} ({verdict(diffs)})")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def accumulation_differences(records: list[dict[str, Any]]) -> str:
    """Each accumulated layout minus the same batch in one micro-batch, per loss, seed by seed: whether
    the step's contrastive batch changes the result (docs/losses.md, Gradient accumulation)."""
    cells = _by_cell(records)
    header = [
        "batch",
        "loss",
        "minus one micro-batch",
        "seeds",
        *(f"Δ {title}" for title in METRICS.values()),
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (layout, variant), runs in sorted(
        cells.items(), key=lambda c: (c[0][0], list(VARIANTS).index(c[0][1]))
    ):
        one = cells.get(((layout[0], 1, "micro"), variant))
        if layout[1] == 1 or one is None:
            continue
        seeds = sorted(set(runs) & set(one))
        if not seeds:
            continue
        row = [_label(layout), VARIANTS[variant][0], str(layout[0]), str(len(seeds))]
        for key in METRICS:
            diffs = [runs[s]["final"][key] - one[s]["final"][key] for s in seeds]
            row.append(f"{_fmt(*mean_std(diffs))} ({verdict(diffs)})")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def verdict(diffs: list[float]) -> str:
    """ "ahead" / "behind" when the 95% t-interval of the mean difference excludes 0, else "level"."""
    if len(diffs) < 2:
        return "one seed"
    mean, std = mean_std(diffs)
    half = t_quantile(len(diffs) - 1) * std / math.sqrt(len(diffs))
    return "ahead" if mean - half > 0 else "behind" if mean + half < 0 else "level"


def plot_curves(records: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    """One row per batch, one column per metric (and τ): mean over seeds, band from min to max."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = _by_cell(records)
    batches = sorted({b for b, _ in cells})
    panels = [*METRICS, "temperature"]
    fig, axes = plt.subplots(
        len(batches), len(panels), figsize=(4.2 * len(panels), 3.4 * len(batches)), squeeze=False
    )
    colors = dict(zip(VARIANTS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for row, batch in enumerate(batches):
        for col, key in enumerate(panels):
            ax = axes[row][col]
            x_key = "temperature_epoch" if key == "temperature" else "epoch"
            for variant in (v for v in VARIANTS if (batch, v) in cells):
                runs = [r["curves"] for r in cells[batch, variant].values() if r["curves"].get(key)]
                if not runs:
                    continue
                length = min(len(c[key]) for c in runs)
                x = runs[0][x_key][:length]
                ys = [c[key][:length] for c in runs]
                mean = [statistics.fmean(v) for v in zip(*ys)]
                ax.plot(x, mean, color=colors[variant], label=VARIANTS[variant][0], lw=1.6)
                if len(ys) > 1:
                    ax.fill_between(
                        x,
                        [min(v) for v in zip(*ys)],
                        [max(v) for v in zip(*ys)],
                        color=colors[variant],
                        alpha=0.15,
                        lw=0,
                    )
            if key == "temperature":  # iSogCLR's per-sample taus may sit at the floor, far below the others
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
                ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            if key in CHANCE_KEYS:
                chance = records[0]["final"][CHANCE_KEYS[key]]
                ax.axhline(chance, color="grey", ls="--", lw=1, label="chance")
                ax.set_ylim(bottom=0)
            ax.set_title(f"{METRICS.get(key, 'temperature τ')}, batch {_label(batch)}")
            ax.set_xlabel("epoch")
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 7), frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97 if title else 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def machine() -> str:
    text = f"{cpu_model()}, {len(os.sched_getaffinity(0))} cores"
    import torch

    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name(0)}"
    return f"{text}, torch {torch.__version__}, Python {platform.python_version()}"


def format_report(
    records: list[dict[str, Any]],
    summary: dict[str, Any],
    specs: list[RunSpec],
    *,
    command: str,
    elapsed: float,
    jobs: int,
) -> str:
    spec = specs[0]
    walls: dict[Layout, list[float]] = {}
    cpus: dict[Layout, list[float]] = {}
    for record in records:
        run = record["spec"]
        layout = (run["batch"], run["accumulate"], run["contrastive"])
        walls.setdefault(layout, []).append(record["wall_s"])
        cpus.setdefault(layout, []).append(record["cpu_s"])
    timing = "; ".join(
        f"batch {_label(b)}: {statistics.fmean(walls[b]):.0f} s wall "
        f"({min(walls[b]):.0f}-{max(walls[b]):.0f}), {statistics.fmean(cpus[b]):.0f} s CPU"
        for b in sorted(walls)
    )
    classes = ", ".join(summary["classnames"])
    threads = f"{records[0]['threads']} torch thread" + ("s" if records[0]["threads"] > 1 else "")
    return f"""# Convergence on real images

- command: `{command}`
- date: {datetime.date.today().isoformat()}; machine: {machine()}
- runs: {len(records)} of {len(specs)} finished; {jobs} at a time; this invocation {elapsed / 60:.1f} min
- run times (mean, each run on {threads}): {timing}
- data: {summary["package"]}: {summary["num_train"]} training pairs, {summary["num_val"]} held-out
  pairs for retrieval, {summary["num_zeroshot"]} held-out drawings in {len(summary["classnames"])}
  classes for zero-shot ({classes}); {summary["image_size"]} px
- recipe: model {spec.model}, fp32, AdamW lr 1e-3 wd 0.1, warm-up {spec.warmup_epochs} epoch(s) then
  cosine to 0, {spec.epochs} epochs, evaluation every {spec.eval_every_epochs} epochs, each loss with its
  own defaults (docs/losses.md)

Final metrics, mean ± sample standard deviation over seeds (final τ: the global temperature at the end,
for iSogCLR the median of the per-sample ones):

{results_table(records)}

{VARIANTS[REFERENCE][0]} minus each other loss, seed by seed (same initialisation and data order), mean ±
standard deviation of the differences; ahead / behind: the 95% t-interval of the mean excludes 0:

{paired_differences(records)}
{_siglip_section(records)}{_accumulation_section(records)}
![curves](curves.png)
"""


def _siglip_section(records: list[dict[str, Any]]) -> str:
    """SigLIP minus each other loss, when the grid ran it: its paper's small-batch claim is the question."""
    if not any(record["spec"]["variant"] == "siglip" for record in records):
        return ""
    return f"""
SigLIP minus each other loss, the same way (its paper finds the sigmoid loss ahead of the softmax one at
small batches):

{paired_differences(records, reference="siglip")}
"""


def _accumulation_section(records: list[dict[str, Any]]) -> str:
    table = accumulation_differences(records)
    if not table:
        return ""
    return f"""
Each accumulated layout minus the same global batch in one micro-batch (the reference's step), per loss,
seed by seed (same initialisation, data order and crops); ahead / behind: the 95% t-interval excludes 0:

{table}
"""
