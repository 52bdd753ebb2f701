"""Planning a resume: which checkpoint a run goes on from, the global batch it keeps, the keys it changes.

The run plan (plan/run_plan.py) asks these before anything is built, read-only (``train --dry-run`` too):
:func:`decide` reads the checkpoint ``--resume`` names and whether it needs converting for this number of
ranks; :func:`layout_keeping` gives the batch layout that keeps its global batch on another number of ranks;
:func:`compare_settings` finds the keys the run changes (checkpointing/resume_config.py's rules), of which
:func:`refusals` are the ones that stop it; :func:`notes` are the start-up log's lines about it. The
checkpointer (checkpointing/checkpointer.py) carries the decision out once the engine exists.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eva_fastclip.checkpointing import checkpoint, resume_config
from eva_fastclip.config import ConfigError, ExperimentConfig
from eva_fastclip.plan.layout import BatchLayout, batch_layout


@dataclass(frozen=True)
class ResumeDecision:
    """The checkpoint a run goes on from, and what going on from it takes."""

    folder: Path
    marker: dict[str, Any]
    """Its COMPLETE.json: step, world size, layout, precision, config, DeepSpeed settings."""
    universal: Path | None
    """Where its conversion for this number of ranks lives (ZeRO partitions of another world size)."""
    changes: tuple[resume_config.Change, ...] = ()
    """The keys this run changes, each with its rule (:func:`refusals`: those that cannot change)."""

    @property
    def saved_ranks(self) -> int:
        return self.marker["world_size"]


def decide(resume: str | Path, root: Path, world_size: int) -> tuple[ResumeDecision | None, list[tuple]]:
    """The checkpoint ``--resume`` names under ``root`` (None: ``latest`` with none yet), and the problem
    with it as (key, message) where there is one."""
    try:
        folder = checkpoint.resolve_resume(str(resume), root)
    except (FileNotFoundError, ValueError) as err:
        return None, [("--resume", str(err))]
    if folder is None:
        return None, []
    converted = checkpoint.needs_conversion(folder, world_size)
    universal = checkpoint.universal_folder(folder) if converted else None
    return ResumeDecision(folder, checkpoint.read_marker(folder), universal), []


def layout_keeping(cfg: ExperimentConfig, world_size: int, decision: ResumeDecision | None) -> BatchLayout:
    """The batch layout; on another number of ranks than the checkpoint's, one that keeps its global batch
    (with train.global_batch the config's is kept: a changed value is the user's choice)."""
    saved = decision.marker.get("global_batch") if decision is not None else None
    if saved is None or decision.saved_ranks == world_size:
        return batch_layout(cfg, world_size)
    try:
        return batch_layout(cfg, world_size, resumed_global=saved)
    except ConfigError as err:
        raise ConfigError(f"{decision.folder} was saved by {decision.saved_ranks} ranks: {err}") from None


def compare_settings(
    decision: ResumeDecision, config: ExperimentConfig, deepspeed: dict[str, Any]
) -> ResumeDecision:
    """The decision with the keys ``config`` and the DeepSpeed settings change against the checkpoint's."""
    saved = checkpoint.saved_settings(decision.folder)
    changes = resume_config.compare(saved, {"config": config.to_dict(), "deepspeed": deepspeed})
    return dataclasses.replace(decision, changes=tuple(changes))


def refusals(decision: ResumeDecision) -> list[tuple[str, str]]:
    """(key, why and the way out) for every key that cannot change on resume."""
    return [(c.key, c.refusal(str(decision.folder))) for c in decision.changes if c.refused]


def notes(decision: ResumeDecision, layout: BatchLayout, cfg: ExperimentConfig) -> list[tuple[int, str]]:
    """The start-up log's line on the global batch a resume on another number of ranks keeps."""
    saved, ranks = decision.marker.get("global_batch"), decision.saved_ranks
    if saved is None or ranks == layout.world_size:
        return []
    folder = decision.folder
    if cfg.train.global_batch is not None:
        if layout.global_batch == saved:
            return []
        line = (
            f"{folder} was saved with a global batch of {saved}; train.global_batch={layout.global_batch} "
            "applies from here"
        )
        return [(logging.INFO, line)]
    if layout.grad_accum_steps == cfg.train.grad_accum_steps:
        return []
    line = (
        f"{folder} was saved by {ranks} ranks: its global batch of {saved} is kept on {layout.world_size} "
        f"ranks with train.grad_accum_steps={layout.grad_accum_steps} (was {cfg.train.grad_accum_steps})"
    )
    return [(logging.INFO, line)]
