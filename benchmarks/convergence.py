"""Convergence on real images: every loss trains the same small CLIP on the same openclipart pairs.

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

import concurrent.futures
import datetime
import itertools
import json
import logging
import math
import multiprocessing
import os
import platform
import resource
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eva_fastclip.data import openclipart

log = logging.getLogger(__name__)

#: variant name -> (label, config overrides). Each loss runs with its own defaults (config.LOSS_DEFAULTS:
#: the values FastCLIP's code runs); FastCLIP-v3 also with RGCL-g's exact τ-gradient, an option.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "openclip": ("OpenCLIP", {"loss.name": "openclip"}),
    "fastclip_v1": ("FastCLIP-v1", {"loss.name": "fastclip_v1"}),
    "fastclip_v3": ("FastCLIP-v3", {"loss.name": "fastclip_v3"}),
    "fastclip_v3_exact": (
        "FastCLIP-v3 (exact τ-gradient)",
        {"loss.name": "fastclip_v3", "loss.tau_gradient": "exact"},
    ),
    "sogclr": ("SogCLR", {"loss.name": "sogclr"}),
    "isogclr": ("iSogCLR", {"loss.name": "isogclr"}),
}
REFERENCE = "fastclip_v3"
DEFAULT_MODEL = "bench-vit-xs"
#: the recipe every run shares: FastCLIP's CC3M recipe (AdamW, lr 1e-3, wd 0.1, cosine to 0) with its
#: ViT optimizer defaults, weight-decay rule and no gradient clipping (docs/recipes.md).
RECIPE: dict[str, Any] = {
    "train.deepspeed_config": "ds_configs/fastclip_adamw_vit.json",
    "train.precision": "fp32",  # explicit: the same numerics on every machine (auto picks bf16 on some)
    "optim.lr": 1e-3,
    "optim.weight_decay": 0.1,
    "optim.weight_decay_rule": "fastclip",
    "optim.min_lr_ratio": 0.0,
    "train.save_every_steps": 0,
    "train.keep_checkpoints": 1,
    # the held-out drawings decode in the run's process: loader workers would be spawned (the runs are)
    # at every evaluation, costing more CPU than the training steps; the results are the same
    "eval.workers": 0,
}
#: bumped when a change of RECIPE or VARIANTS changes results (not e.g. eval.workers, which only moves the
#: decoding between processes), so results of an older recipe are never mixed with new ones.
#: 1: 2026-11-23 (zero1_adamw.json, clipping 1.0, v3 exact τ-gradient, one-time τ-lr drop, iSogCLR's
#: momentum rule); 2: 2026-11-25 (the corrected defaults above).
RECIPE_VERSION = 2
#: what the curves and tables show: key of the evaluation results (TensorBoard: eval/<key>) -> title
METRICS: dict[str, str] = {
    "zeroshot_top1": "zero-shot top-1",
    "retrieval_image_to_text_R@1": "image→text R@1",
    "retrieval_text_to_image_R@1": "text→image R@1",
}
CHANCE_KEYS = {
    "zeroshot_top1": "zeroshot_top1_chance",
    "retrieval_image_to_text_R@1": "retrieval_R@1_chance",
    "retrieval_text_to_image_R@1": "retrieval_R@1_chance",
}


@dataclass(frozen=True)
class RunSpec:
    """One run; everything that must match for a saved result to count as this run."""

    variant: str
    batch: int
    seed: int
    epochs: int
    model: str
    eval_every_epochs: int
    warmup_epochs: int
    num_train: int
    image_size: int
    recipe_version: int = RECIPE_VERSION
    accumulate: int = 1  # micro-batches of batch / accumulate per optimizer step
    contrastive: str = "micro"  # train.contrastive_batch, where accumulate > 1

    @property
    def name(self) -> str:
        layout = "" if self.accumulate == 1 else f"-a{self.accumulate}{self.contrastive}"
        return f"{self.variant}-b{self.batch}{layout}-s{self.seed}"

    @property
    def steps_per_epoch(self) -> int:
        return self.num_train // self.batch

    def overrides(self, data_dir: Path, run_dir: Path) -> list[str]:
        steps = self.steps_per_epoch
        values = {
            **RECIPE,
            **VARIANTS[self.variant][1],
            "model.name": self.model,
            "data.train_shards": [str(data_dir / "train")],
            "eval.retrieval_shards": [str(data_dir / "val")],
            "eval.zeroshot_dir": str(data_dir / "zeroshot"),
            "eval.every_steps": steps * self.eval_every_epochs,
            "optim.warmup_steps": steps * self.warmup_epochs,
            "train.batch_size": self.batch // self.accumulate,
            "train.grad_accum_steps": self.accumulate,
            "train.contrastive_batch": self.contrastive,
            "train.epochs": self.epochs,
            "train.seed": self.seed,
            "train.output_dir": str(run_dir),
            "train.log_every_steps": steps,  # one temperature point per epoch
        }
        return [f"{key}={json.dumps(value)}" for key, value in values.items()]


def plan_runs(
    variants: list[str],
    batches: list[int],
    seeds: list[int],
    layouts: list[tuple[int, str]] = ((1, "micro"),),
    **common: Any,
) -> list[RunSpec]:
    """Seed-major order: an interrupted benchmark has whole seeds of every variant, not some variants.
    ``layouts``: (micro-batches a step, train.contrastive_batch) of each batch."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    for batch, (accumulate, _) in itertools.product(batches, layouts):
        if batch % accumulate:
            raise ValueError(f"batch {batch} does not split into {accumulate} micro-batches")
    return [
        RunSpec(variant=v, batch=b, seed=s, accumulate=a, contrastive=c, **common)
        for s in seeds
        for b in batches
        for a, c in layouts
        for v in variants
    ]


# ---- one run (in its own process) -----------------------------------------------------------------------


class MemoryLoader:
    """The training split decoded and tokenised once, held as tensors: what ``Trainer`` needs of a loader.

    Decoding and tokenising in the loop (``TrainLoader``) took more CPU than the tiny model's step. Each
    epoch is a fresh permutation seeded by (seed, epoch), every sample once; each optimizer step's pairs
    get open_clip's training crop (``RandomResizedCrop``, area 0.9-1, aspect 3/4-4/3), done on tensors by
    one grid_sample, and leave as ``micro_batches`` micro-batches of ``batch_size``: the same pairs and
    crops however a step is split. Indices and the per-sample table's size are read as ``TrainLoader`` reads
    them (``.json[index_key]``, the shards' size records).
    """

    def __init__(
        self,
        source: Path,
        *,
        preprocess,
        tokenize,
        batch_size: int,
        seed: int,
        index_key: str = "key",
        micro_batches: int = 1,
    ) -> None:
        import torch
        import webdataset as wds

        from eva_fastclip.data import expand_urls, resolve_sizes
        from eva_fastclip.data.tar_reader import parse_index

        urls = expand_urls(str(source))
        sizes = resolve_sizes(urls, index_key=index_key)
        pipeline = wds.DataPipeline(
            wds.SimpleShardList(urls),
            wds.tarfile_to_samples(),
            wds.decode("pil"),
            wds.to_tuple("png;jpg;jpeg;webp", "txt", "json"),
        )
        images, captions, indices = [], [], []
        for image, caption, meta in pipeline:
            index = parse_index(meta.get(index_key))
            if index is None or index >= sizes.index_size:
                raise ValueError(
                    f"{source}: a sample has {index_key}={meta.get(index_key)!r}, not an index in "
                    f"[0, {sizes.index_size}) ({sizes.index_size_from}); convert the data again"
                )
            images.append(preprocess(image))
            captions.append(caption.splitlines()[0])
            indices.append(index)
        if len(indices) != sizes.num_samples:
            raise ValueError(
                f"{source} holds {len(indices)} samples, its {sizes.num_samples_from} says "
                f"{sizes.num_samples}: convert the data again"
            )
        self.images = torch.stack(images)
        self.tokens = tokenize(captions)
        self.indices = torch.tensor(indices, dtype=torch.int64)
        self.dataset_size = sizes.index_size
        self.num_samples = len(indices)
        self.micro_batches = micro_batches
        self.num_batches = self.num_samples // (batch_size * micro_batches) * micro_batches
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        import torch

        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.num_samples, generator=generator)
        step, b = self.batch_size * self.micro_batches, self.batch_size
        for start in range(0, self.num_batches * b, step):
            pairs = order[start : start + step]
            images = random_resized_crop(self.images[pairs], generator)
            for t in range(self.micro_batches):
                micro = pairs[t * b : (t + 1) * b]
                yield images[t * b : (t + 1) * b], self.tokens[micro], self.indices[micro]


def random_resized_crop(images, generator, scale=(0.9, 1.0), ratio=(3 / 4, 4 / 3)):
    """A random crop of each image (area fraction in ``scale``, aspect in ``ratio``) resized to full size."""
    import torch
    import torch.nn.functional as F

    n = len(images)
    area = torch.empty(n).uniform_(*scale, generator=generator)
    aspect = torch.exp(torch.empty(n).uniform_(math.log(ratio[0]), math.log(ratio[1]), generator=generator))
    width = torch.sqrt(area * aspect).clamp(max=1.0)  # fractions of the side
    height = torch.sqrt(area / aspect).clamp(max=1.0)
    # crop centre, in grid_sample's [-1, 1] coordinates, anywhere the crop stays inside the image
    cx = (torch.rand(n, generator=generator) * 2 - 1) * (1 - width)
    cy = (torch.rand(n, generator=generator) * 2 - 1) * (1 - height)
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0], theta[:, 0, 2], theta[:, 1, 1], theta[:, 1, 2] = width, cx, height, cy
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)


def run_one(spec: RunSpec, data_dir: Path, out_dir: Path, threads: int) -> dict[str, Any]:
    """Train and evaluate one run in this process, write ``results/<name>.json``; returns the record.

    The benchmark gives every run a process of its own (``_child``); the run's folder must hold no run yet.
    """
    import torch

    from eva_fastclip.config import load_config
    from eva_fastclip.engine.trainer import Trainer
    from eva_fastclip.models import create_model
    from eva_fastclip.plan.deepspeed_json import load_deepspeed_config

    run_dir = out_dir / "runs" / spec.name
    start = time.perf_counter()
    cfg = load_config(None, spec.overrides(data_dir, run_dir))
    bundle = create_model(cfg.model)
    loader = MemoryLoader(
        data_dir / "train",
        preprocess=bundle.preprocess_eval,  # the crop is the loader's: one resize to the model's size here
        tokenize=bundle.tokenizer,
        batch_size=spec.batch // spec.accumulate,
        seed=spec.seed,
        index_key=cfg.data.index_key,
        micro_batches=spec.accumulate,
    )
    trainer = Trainer(cfg, load_deepspeed_config(cfg.train.deepspeed_config), loader=loader)
    torch.set_num_threads(threads)  # the Trainer gives one rank all cores; parallel runs share them
    trainer.evaluate()  # the untrained model: the curves start at epoch 0
    final = trainer.train()
    wall = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # only the metrics are kept
    scalars = read_scalars(run_dir / "tensorboard")
    record = {
        "spec": asdict(spec),
        "steps_per_epoch": spec.steps_per_epoch,
        "total_steps": trainer.total_steps,
        "curves": curves_from_scalars(scalars, spec.steps_per_epoch),
        "final": final,
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,  # the process's own work, whatever else ran beside it
        "threads": threads,
        "finished": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    write_json(out_dir / "results" / f"{spec.name}.json", record)
    return record


def _child(spec: RunSpec, data_dir: Path, out_dir: Path, threads: int) -> dict[str, Any]:
    """One run in the benchmark's worker process, in a fresh folder, everything it prints in its train.log."""
    try:
        run_dir = out_dir / "runs" / spec.name
        if run_dir.exists():  # a run cut short: start it again from scratch
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        stream = open(run_dir / "train.log", "w", buffering=1)  # noqa: SIM115 (lives as long as the process)
        os.dup2(stream.fileno(), sys.stdout.fileno())
        os.dup2(stream.fileno(), sys.stderr.fileno())
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return run_one(spec, data_dir, out_dir, threads)
    except BaseException as err:  # the parent sees the message; the traceback is in the run's train.log
        import traceback

        traceback.print_exc()
        log_file = out_dir / "runs" / spec.name / "train.log"
        raise RuntimeError(f"{spec.name} failed: {err!r} (see {log_file})") from None


def read_scalars(tensorboard_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} over every event file of a run (a later value at the same step wins)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, dict[int, float]] = {}
    for events in sorted(Path(tensorboard_dir).glob("events.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in accumulator.Scalars(tag)})
    return scalars


def curves_from_scalars(scalars: dict[str, dict[int, float]], steps_per_epoch: int) -> dict[str, Any]:
    """The evaluation curves and the temperature, against epochs."""
    missing = [f"eval/{key}" for key in METRICS if f"eval/{key}" not in scalars]
    if missing:
        raise ValueError(f"the run logged no {missing}: was evaluation configured?")
    steps = sorted(scalars["eval/zeroshot_top1"])
    curves: dict[str, Any] = {"epoch": [s / steps_per_epoch for s in steps]}
    for key in METRICS:
        curves[key] = [scalars[f"eval/{key}"][s] for s in steps]
    # a global temperature (openclip, v1, v3, sogclr) or the median of the individual ones (isogclr)
    tag = next((t for t in ("train/temperature", "train/temperature_q50") if t in scalars), None)
    if tag is not None:
        tau_steps = sorted(scalars[tag])
        curves["temperature_epoch"] = [s / steps_per_epoch for s in tau_steps]
        curves["temperature"] = [scalars[tag][s] for s in tau_steps]
    return curves


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)  # a result file exists only complete: the resume check relies on it


# ---- aggregation -----------------------------------------------------------------------------------------


def load_results(out_dir: Path, specs: list[RunSpec]) -> tuple[list[dict[str, Any]], list[RunSpec]]:
    """(records of finished runs, specs still to run). A record made with other settings stops it."""
    done, todo = [], []
    for spec in specs:
        path = out_dir / "results" / f"{spec.name}.json"
        if not path.is_file():
            todo.append(spec)
            continue
        record = json.loads(path.read_text())
        record["spec"] = {**_SPEC_DEFAULTS, **record["spec"]}  # from before a key existed: its default
        wanted = asdict(spec)
        if record["spec"] != wanted:
            keys = sorted(record["spec"].keys() | wanted.keys())
            changed = {
                k: (record["spec"].get(k), wanted.get(k))
                for k in keys
                if record["spec"].get(k) != wanted.get(k)
            }
            raise ValueError(
                f"{path} was made with other settings {changed} (saved, requested): use another --output, "
                "or delete the results folder to start again"
            )
        done.append(record)
    return done, todo


_SPEC_DEFAULTS = {"accumulate": 1, "contrastive": "micro"}


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


# ---- the benchmark ---------------------------------------------------------------------------------------


def machine() -> str:
    from benchmarks.speed import cpu_model

    text = f"{cpu_model()}, {len(os.sched_getaffinity(0))} cores"
    import torch

    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name(0)}"
    return f"{text}, torch {torch.__version__}, Python {platform.python_version()}"


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
    failures = []
    if todo:
        context = multiprocessing.get_context("spawn")  # a fresh process group and allocator per run
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context, max_tasks_per_child=1) as pool:
            futures = {pool.submit(_child, spec, Path(data), output, threads): spec for spec in todo}
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
                    len(specs),
                    spec.name,
                    record["wall_s"],
                    final["zeroshot_top1"],
                    final["retrieval_image_to_text_R@1"],
                    final["retrieval_text_to_image_R@1"],
                )
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


def _check_configs(specs: list[RunSpec], data_dir: Path) -> None:
    """Every run's config must validate before the first one starts (a typo must not cost an hour)."""
    from eva_fastclip.config import ConfigError, load_config

    for variant in dict.fromkeys(spec.variant for spec in specs):
        spec = next(s for s in specs if s.variant == variant)
        try:
            load_config(None, spec.overrides(data_dir, Path("unused")))
        except ConfigError as err:
            raise ConfigError(f"variant {variant}: {err}") from None


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
{_accumulation_section(records)}
![curves](curves.png)
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
