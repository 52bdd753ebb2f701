"""The run plan: everything a run decides before it builds anything, made by one function.

``make_plan(config, DeepSpeed JSON, world size, hardware, resume target)`` works out, in this order:

1. the checkpoint to resume (``--resume``: ``latest`` or a folder), read-only: its marker says how many
   ranks saved it, its global batch, precision, config and DeepSpeed settings;
2. the batch layout on ``world_size`` ranks (a checkpoint's global batch kept on another number of ranks);
3. the checks before step 1 (plan/preflight.py): every path the run reads or writes, the data's sizes and
   the schedule's lengths; the keys a resumed run may not change;
4. the precision for ``hardware`` (a resumed run keeps its checkpoint's) and the resolved DeepSpeed JSON;
5. the run's length and what derives from it (gamma's horizon).

The result holds the run's own config: the given one with what the plan derived written in
(``train.grad_accum_steps`` that keeps a checkpoint's global batch, ``loss.gamma_decay_epochs``), a new
object; the given config is never changed. ``train``, ``train --dry-run``, ``tune`` and the benchmarks take
their plan from here; the Trainer builds from a plan and works nothing of it out again.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eva_fastclip.checkpointing import checkpoint, resume_config
from eva_fastclip.config import ConfigError, ExperimentConfig, gamma_decay_epochs_for
from eva_fastclip.plan import preflight
from eva_fastclip.plan.deepspeed_json import resolve_deepspeed_config
from eva_fastclip.plan.layout import BatchLayout, batch_layout
from eva_fastclip.plan.precision import (
    Hardware,
    PrecisionChoice,
    choose_precision,
    for_resume,
    precision_in_deepspeed_json,
)
from eva_fastclip.plan.preflight import Problem, Report

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumeDecision:
    """The checkpoint a run goes on from, and what going on from it takes."""

    folder: Path
    marker: dict[str, Any]
    """Its COMPLETE.json: step, world size, layout, precision, config, DeepSpeed settings."""
    universal: Path | None
    """Where its conversion for this number of ranks lives (ZeRO partitions of another world size)."""
    changes: tuple[resume_config.Change, ...] = ()
    """The keys this run changes, each with its rule (a refused one is also a preflight error)."""

    @property
    def saved_ranks(self) -> int:
        return self.marker["world_size"]


@dataclass(frozen=True)
class RunPlan:
    config: ExperimentConfig
    """The run's config: the given one with the derived values written in (see the module's docstring)."""
    world_size: int
    layout: BatchLayout
    hardware: Hardware
    precision: PrecisionChoice
    deepspeed: dict[str, Any]
    """The resolved DeepSpeed JSON the engine is built from."""
    preflight: Report
    """Every problem found (errors stop the run: :meth:`raise_for_errors`), the data's sizes, the length."""
    epoch_batches: int | None = None
    """Micro-batches each rank draws per epoch (None where the data was not read)."""
    resume: ResumeDecision | None = None
    notes: tuple[tuple[int, str], ...] = field(default=())
    """(logging level, line) for rank 0's start-up log: the layout, the precision, what the plan derived."""

    @property
    def steps_per_epoch(self) -> int | None:
        return None if self.epoch_batches is None else self.epoch_batches // self.layout.grad_accum_steps

    @property
    def total_steps(self) -> int | None:
        return self.preflight.total_steps

    def raise_for_errors(self, *, log_warnings: bool = True) -> None:
        preflight.raise_for_errors(self.preflight.problems, log_warnings=log_warnings)

    def log_notes(self) -> None:
        for level, line in self.notes:
            log.log(level, "%s", line)

    def summary(self) -> dict[str, Any]:
        """What ``train --dry-run`` prints."""
        layout = self.layout
        return {
            "world_size": self.world_size,
            "global_batch": layout.global_batch,
            # what the run's start-up log states: share per rank, micro-batch, accumulation, contrastive batch
            "batch": {**layout.summary(), "derived_from": layout.source, "warnings": layout.warnings()},
            "data": preflight.sizes_dict(self.preflight),
            "preflight": self.preflight.to_dict(),
            "precision": {
                "name": self.precision.name,
                "reason": self.precision.reason,
                "warning": self.precision.warning,
            },
            "resume": None if self.resume is None else str(self.resume.folder),
            "experiment": self.config.to_dict(),
            "deepspeed": self.deepspeed,
        }


def make_plan(
    cfg: ExperimentConfig,
    ds: dict[str, Any],
    *,
    world_size: int,
    hardware: Hardware,
    resume: str | Path | None = None,
    loader_batches: int | None = None,
    inputs: bool = True,
) -> RunPlan:
    """The plan of ``cfg`` on ``world_size`` ranks of ``hardware``.

    ``resume``: ``--resume``'s value (``latest`` or a checkpoint folder; ``latest`` without a checkpoint is
    a fresh start). ``loader_batches``: a stand-in loader's micro-batches per epoch (tests, benchmarks, tune's
    probes), in place of the training shards, which are then neither checked nor read. ``inputs=False``
    checks no file at all (a plan for GPUs elsewhere: ``tune --estimate-only``). A config that cannot make
    its layout, or a resumed precision that conflicts, raises ConfigError; every other problem is in
    ``plan.preflight`` for the caller to print or raise (:meth:`RunPlan.raise_for_errors`).
    """
    source = cfg.train.deepspeed_config
    root = Path(cfg.train.output_dir) / "checkpoints"
    report = Report()
    decision = _resume_decision(resume, root, world_size, report) if inputs and resume is not None else None
    saved_global = decision.marker.get("global_batch") if decision is not None else None
    layout = _layout(cfg, world_size, decision, saved_global)
    if inputs:
        report.problems += preflight.check_inputs(cfg, resume=resume, train_shards=loader_batches is None)
    epoch_batches = loader_batches
    if inputs and loader_batches is None:
        epoch_batches = _read_sizes(cfg, layout, report)
    elif epoch_batches is not None:
        report.problems += preflight.check_schedule(cfg, layout, epoch_batches)
    if epoch_batches is not None and epoch_batches >= layout.grad_accum_steps:
        report.total_steps = preflight.total_steps(cfg, layout, epoch_batches)
    notes = [(logging.INFO, f"batch: {layout.describe()}")]
    notes += [(logging.WARNING, warning) for warning in layout.warnings()]
    config = _derived_config(cfg, layout, epoch_batches, report.total_steps, notes)
    precision = _precision(cfg, ds, hardware, decision)
    notes.append((logging.INFO, f"precision: {precision.name} ({precision.reason})"))
    if precision.warning:
        notes.append((logging.WARNING, precision.warning))
    resolved = resolve_deepspeed_config(ds, config, layout, source=source, precision=precision)
    if decision is not None:
        decision = _compare_settings(decision, config, resolved, report)
        if decision.universal is not None:
            resolved["checkpoint"] = {**resolved.get("checkpoint", {}), "load_universal": True}
        notes += _resume_notes(decision, layout, cfg)
    return RunPlan(
        config=config,
        world_size=world_size,
        layout=layout,
        hardware=hardware,
        precision=precision,
        deepspeed=resolved,
        preflight=report,
        epoch_batches=epoch_batches,
        resume=decision,
        notes=tuple(notes),
    )


# ---- the resume decision -------------------------------------------------------------------------------


def _resume_decision(resume, root: Path, world_size: int, report: Report) -> ResumeDecision | None:
    """The checkpoint ``--resume`` names (None: ``latest`` with none yet, or a problem in ``report``)."""
    try:
        folder = checkpoint.resolve_resume(str(resume), root)
    except (FileNotFoundError, ValueError) as err:
        report.problems.append(Problem("--resume", str(err)))
        return None
    if folder is None:
        return None
    marker = checkpoint.read_marker(folder)
    converted = checkpoint.needs_conversion(folder, world_size)
    return ResumeDecision(folder, marker, checkpoint.universal_folder(folder) if converted else None)


def _layout(
    cfg: ExperimentConfig, world_size: int, decision: ResumeDecision | None, saved_global: int | None
) -> BatchLayout:
    """The batch layout; on another number of ranks than the checkpoint's, one that keeps its global batch
    (with train.global_batch the config's is kept: a changed value is the user's choice)."""
    if decision is None or saved_global is None or decision.saved_ranks == world_size:
        return batch_layout(cfg, world_size)
    try:
        return batch_layout(cfg, world_size, resumed_global=saved_global)
    except ConfigError as err:
        raise ConfigError(f"{decision.folder} was saved by {decision.saved_ranks} ranks: {err}") from None


def _compare_settings(
    decision: ResumeDecision, config: ExperimentConfig, resolved: dict[str, Any], report: Report
) -> ResumeDecision:
    """The keys this run changes against the checkpoint's; those that cannot change are errors."""
    saved = checkpoint.saved_settings(decision.folder)
    new = {"config": config.to_dict(), "deepspeed": resume_config.deepspeed_settings(resolved)}
    changes = tuple(resume_config.compare(saved, new))
    where = str(decision.folder)
    report.problems += [Problem(c.key, c.refusal(where)) for c in changes if c.refused]
    return dataclasses.replace(decision, changes=changes)


def _resume_notes(decision: ResumeDecision, layout: BatchLayout, cfg: ExperimentConfig) -> list:
    saved, ranks = decision.marker.get("global_batch"), decision.saved_ranks
    if saved is None or ranks == layout.world_size:
        return []
    folder = decision.folder
    if cfg.train.global_batch is not None:
        if layout.global_batch == saved:
            return []
        return [
            (
                logging.INFO,
                f"{folder} was saved with a global batch of {saved}; train.global_batch="
                f"{layout.global_batch} applies from here",
            )
        ]
    if layout.grad_accum_steps == cfg.train.grad_accum_steps:
        return []
    return [
        (
            logging.INFO,
            f"{folder} was saved by {ranks} ranks: its global batch of {saved} is kept on "
            f"{layout.world_size} ranks with train.grad_accum_steps={layout.grad_accum_steps} (was "
            f"{cfg.train.grad_accum_steps})",
        )
    ]


# ---- data, length, precision ---------------------------------------------------------------------------


def _read_sizes(cfg: ExperimentConfig, layout: BatchLayout, report: Report) -> int | None:
    """The training shards checked and their sizes read; the micro-batches a rank draws per epoch (whole
    optimizer steps, as the loader cuts them), or None where they could not be read."""
    urls, problems = preflight.check_train_shards(cfg)
    report.problems += problems
    if urls is None:
        return None
    try:
        report.sizes = preflight.data_sizes(cfg, urls)
    except ValueError as err:
        key = next((k for k in ("data.num_samples", "data.index_size") if k in str(err)), "data.train_shards")
        report.problems.append(Problem(key, str(err)))
        return None
    samples = report.sizes.num_samples
    report.problems += preflight.check_schedule(
        cfg, layout, samples // layout.samples_per_forward, num_samples=samples
    )
    return samples // layout.global_batch * layout.grad_accum_steps


def _derived_config(
    cfg: ExperimentConfig, layout: BatchLayout, epoch_batches: int | None, total: int | None, notes: list
) -> ExperimentConfig:
    """``cfg`` with the accumulation of its layout and gamma's horizon from the run's length (a copy)."""
    train, loss = cfg.train, cfg.loss
    if train.global_batch is None and train.grad_accum_steps != layout.grad_accum_steps:
        train = dataclasses.replace(train, grad_accum_steps=layout.grad_accum_steps)
    if loss.name != "openclip" and loss.gamma_decay_epochs is None and total and epoch_batches:
        # train.steps sets the run's length: as many epochs as its micro-batches take
        epochs = math.ceil(total * layout.grad_accum_steps / epoch_batches)
        loss = dataclasses.replace(loss, gamma_decay_epochs=gamma_decay_epochs_for(epochs))
        notes.append(
            (logging.INFO, f"gamma decays over {loss.gamma_decay_epochs} epochs, half of the run's {epochs}")
        )
    if train is cfg.train and loss is cfg.loss:
        return cfg
    return dataclasses.replace(cfg, train=train, loss=loss)


def _precision(
    cfg: ExperimentConfig, ds: dict[str, Any], hardware: Hardware, decision: ResumeDecision | None
) -> PrecisionChoice:
    """The precision for ``hardware``; a resumed run goes on in the precision it was trained in."""
    source = cfg.train.deepspeed_config
    in_json = precision_in_deepspeed_json(ds, source)
    choice = choose_precision(cfg.train.precision, in_json, hardware, source=source)
    if decision is None:
        return choice
    explicit = cfg.train.precision != "auto" or in_json != "auto"
    saved = checkpoint.saved_precision(decision.folder)
    return for_resume(choice, saved, explicit=explicit, checkpoint=str(decision.folder))
