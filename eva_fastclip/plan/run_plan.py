"""The run plan: everything a run decides before it builds anything, made by one function.

``make_plan(config, DeepSpeed JSON, world size, hardware, resume target)`` works out, in this order:

1. the checkpoint to resume (``--resume``: ``latest`` or a folder; checkpointing/resume_plan.py), read-only:
   its marker says how many ranks saved it, its global batch, precision, config and DeepSpeed settings;
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

from eva_fastclip.checkpointing import checkpoint, resume_config, resume_plan
from eva_fastclip.checkpointing.resume_plan import ResumeDecision
from eva_fastclip.config import ExperimentConfig, gamma_decay_epochs_for
from eva_fastclip.plan import preflight
from eva_fastclip.plan.deepspeed_json import resolve_deepspeed_config
from eva_fastclip.plan.layout import BatchLayout
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
    decision = None
    if inputs and resume is not None:
        decision, problems = resume_plan.decide(resume, root, world_size)
        report.problems += [Problem(key, message) for key, message in problems]
    layout = resume_plan.layout_keeping(cfg, world_size, decision)
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
        decision = resume_plan.compare_settings(decision, config, resume_config.deepspeed_settings(resolved))
        report.problems += [Problem(key, why) for key, why in resume_plan.refusals(decision)]
        if decision.universal is not None:
            resolved["checkpoint"] = {**resolved.get("checkpoint", {}), "load_universal": True}
        notes += resume_plan.notes(decision, layout, cfg)
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


# ---- data, length, precision ---------------------------------------------------------------------------


def _read_sizes(cfg: ExperimentConfig, layout: BatchLayout, report: Report) -> int | None:
    """The training shards checked and their sizes read; the micro-batches a rank draws per epoch (whole
    optimizer steps, as the loader cuts them), or None where they could not be read."""
    _, report.sizes, problems = preflight.train_data(cfg)
    report.problems += problems
    if report.sizes is None:
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
    if loss.is_compositional and loss.gamma_decay_epochs is None and total and epoch_batches:
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
