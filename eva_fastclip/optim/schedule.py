"""The learning-rate schedule: linear warm-up, then cosine decay to ``optim.min_lr_ratio``, stretched when
a resumed run changes its length; the temperature's own group keeps a constant lr."""

from __future__ import annotations

import copy
import math

import torch

from eva_fastclip.config import ExperimentConfig
from eva_fastclip.optim.param_groups import TEMPERATURE_GROUP


def warmup_cosine(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """lr multiplier for optimizer step ``step`` (0-based): linear warm-up to 1, then cosine to min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosine:
    """:func:`warmup_cosine` as LambdaLR's multiplier, for a run whose length may change on resume.

    LambdaLR saves the attributes of a callable object with its state, so a checkpoint carries the length
    its schedule was built for. A resumed run of another length (``train.steps`` or ``train.epochs``
    changed) calls :meth:`retarget`: the rest of the cosine is stretched (or squeezed) over the new
    remaining steps from the point it had reached, so the lr goes on from where it stood. The warm-up
    does not depend on the length and is never changed.
    """

    def __init__(self, warmup: int, total: int, min_ratio: float) -> None:
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio
        # the cosine's progress p is linear in the step from (anchor_step, anchor_progress) to (total, 1)
        self.anchor_step, self.anchor_progress = warmup, 0.0

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, self.progress(step))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def progress(self, step: int) -> float:
        """How far the cosine has come at ``step`` (0: its start, 1 and above: its end)."""
        span = max(1, self.total - self.anchor_step)
        return self.anchor_progress + (1.0 - self.anchor_progress) * (step - self.anchor_step) / span

    def retarget(self, step: int, total: int) -> None:
        """From ``step`` (the next optimizer step) on, end the cosine at ``total`` instead: the multiplier
        at ``step`` stays what it was."""
        if total == self.total:
            return
        if step > self.warmup:
            self.anchor_step, self.anchor_progress = step, min(1.0, self.progress(step))
        self.total = total


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ExperimentConfig, total_steps: int):
    """The warm-up + cosine schedule, applied to each group's own peak lr (so per-group ratios hold);
    the temperature's own group (rgcl_g) keeps a constant lr."""
    schedule = WarmupCosine(cfg.optim.warmup_steps, total_steps, cfg.optim.min_lr_ratio)
    lambdas = [_constant if g.get("name") == TEMPERATURE_GROUP else schedule for g in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)


def retarget_schedule(scheduler, step: int, total_steps: int) -> WarmupCosine | None:
    """After loading a checkpoint: stretch the decay to ``total_steps`` (see :class:`WarmupCosine`).
    Returns the schedule as it was saved (None if the scheduler has none of ours)."""
    ours = [fn for fn in scheduler.lr_lambdas if isinstance(fn, WarmupCosine)]
    if not ours:
        return None
    saved = copy.copy(ours[0])
    for fn in {id(fn): fn for fn in ours}.values():  # the groups share one object
        fn.retarget(step, total_steps)
    return saved


def _constant(step: int) -> float:
    return 1.0
