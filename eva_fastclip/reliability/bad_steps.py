"""Non-finite steps: counted, undone where they left a trace, and the run stopped before it saves them.

DeepSpeed skips an optimizer step whose gradients are not finite (ZeRO, bf16's check, fp16's scaler), and
fp32 without ZeRO applies a step whose loss was not finite. :class:`BadSteps` counts the steps in a row that
were either (the verdict over ranks: one rank's loss may be finite where another's is not, so every rank
stops at the same step) and stops the run after ``train.max_skipped_steps`` of them; a bad step's forward
passes still moved BatchNorm's running statistics, which it puts back. A save after applied non-finite
steps is refused when the weights are no longer finite: it would also delete an older good checkpoint
(``train.keep_checkpoints``). Either way :class:`NonFiniteSteps` names the last complete checkpoint.

Every step boundary ends in one collective (:func:`agree`), which carries this verdict beside the other
decisions every rank must take together: a stop asked for (reliability/preemption.py) and a save due by
time (``train.save_every_minutes``, decided by rank 0's clock).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class NonFiniteSteps(RuntimeError):
    """Too many optimizer steps in a row were skipped or not finite, or the weights are no longer finite;
    the message names the step and the last complete checkpoint. Every rank raises it at the same step."""


def agree(*flags: bool, device: torch.device, world_size: int) -> tuple[bool, ...]:
    """Each flag, true where it is true on any rank: the step boundary's one collective (a MAX)."""
    values = torch.tensor([float(flag) for flag in flags], device=device)
    if world_size > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return tuple(bool(value) for value in values.tolist())


class BadSteps:
    """The count of bad steps in a row, and BatchNorm's running statistics from before the step."""

    def __init__(self, limit: int, running_stats: list[torch.Tensor], *, is_main: bool) -> None:
        self.limit = limit
        self.in_a_row = 0  # optimizer steps in a row, up to the current one, that were skipped or not finite
        self.running_stats = running_stats  # BatchNorm's (RN towers), which a skipped step must not move
        self._before: list[torch.Tensor] | None = None
        self.is_main = is_main

    def step_started(self) -> None:
        """At a step's first micro-batch: the running statistics as they stand."""
        if self._before is None:
            self._before = [buffer.clone() for buffer in self.running_stats]

    def step_ended(self, bad: bool, step: int, metrics: dict[str, float], checkpoints: Path) -> None:
        """Count the step (``bad``: the verdict over ranks); undo its trace on the running statistics; stop
        the run (NonFiniteSteps) after ``limit`` bad steps in a row."""
        self.in_a_row = self.in_a_row + 1 if bad else 0
        before, self._before = self._before, None
        if self.in_a_row:
            # the forward passes updated the running statistics from the non-finite batch even where the step
            # was skipped; NaN there never leaves (mean <- m*mean + (1-m)*x) and rank 0's are saved
            for buffer, saved in zip(self.running_stats, before or (), strict=True):
                buffer.copy_(saved)
        metrics["skipped_in_a_row"] = float(self.in_a_row)
        if not self.in_a_row:
            return
        if self.is_main:
            why = "non-finite loss" if metrics["step_applied"] else "skipped (non-finite gradients)"
            log.warning(
                "step %d: %s; %d such step(s) in a row (train.max_skipped_steps=%d%s)",
                step,
                why,
                self.in_a_row,
                self.limit,
                "" if self.limit else ": the run never stops for them",
            )
        if self.limit and self.in_a_row >= self.limit:
            first = step - self.in_a_row + 1
            raise stop(
                step,
                f"{self.in_a_row} optimizer steps in a row (steps {first}-{step}) were skipped for "
                f"non-finite gradients or had a non-finite loss (train.max_skipped_steps={self.limit})",
                checkpoints,
            )

    def check_before_save(
        self, module: torch.nn.Module, step: int, world_size: int, checkpoints: Path
    ) -> None:
        """After applied non-finite steps (fp32 without ZeRO) the weights may be NaN: never save those."""
        if self.in_a_row and not weights_finite(module, self.running_stats, world_size):
            raise stop(
                step,
                f"the weights are no longer finite after {self.in_a_row} non-finite step(s) in a row",
                checkpoints,
            )


def weights_finite(module: torch.nn.Module, running_stats: list[torch.Tensor], world_size: int) -> bool:
    """Whether every weight and BatchNorm statistic is finite, on every rank (the verdict is reduced: the
    statistics are each rank's own, and rank 0's are saved). Not every buffer: the text tower's causal
    attention mask holds -inf by design."""
    stats = (b for b in running_stats if b.is_floating_point())
    tensors = [*module.parameters(), *stats]
    finite = torch.stack([torch.isfinite(t.detach()).all() for t in tensors]).all().float()
    if world_size > 1:
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return bool(finite.item())


def stop(step: int, what: str, checkpoints: Path) -> NonFiniteSteps:
    """NonFiniteSteps naming the step and the checkpoint to resume from; nothing is saved."""
    from eva_fastclip.checkpointing.checkpoint import complete_checkpoints

    found = complete_checkpoints(checkpoints)
    if found:
        last = f"the last complete checkpoint, {found[-1]}, is intact: resume from it with --resume latest"
    else:
        last = f"there is no complete checkpoint under {checkpoints} yet: start again"
    return NonFiniteSteps(
        f"step {step}: {what}. The run stops without saving; {last} once the cause is found (the "
        "data of those steps, the lr, the precision). train.max_skipped_steps=0 never stops for "
        "skipped steps."
    )
