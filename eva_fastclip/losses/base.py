"""The contract between a contrastive loss and the trainer.

A loss turns this rank's L2-normalised features (and their dataset indices) into a scalar to backprop.
Losses that keep per-sample state (the compositional family) *stage* updates in ``forward`` and make them
permanent in ``on_step_applied``; the trainer calls it only when the engine really applied the optimizer
step (``engine.was_step_applied()``), and calls ``on_step_skipped`` otherwise (fp16 overflow, non-finite
gradients), so a skipped step leaves every piece of state exactly as it was.

A cached step (``train.contrastive_batch: global``, engine/cached_step.py) evaluates the loss of a whole
optimizer step's pairs instead: ``begin_cached_step`` with every micro-batch's features from a pass
without autograd (the loss gathers them over the ranks; per-sample state is staged here, once per step),
then ``cached_forward`` once per micro-batch with its features live, whose gradients (averaged over the
ranks and micro-batches, as the engine does) are those of one evaluation over all G pairs, then
``end_cached_step``. ``forward`` is the same with one micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from eva_fastclip.losses.gather import Gatherer


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Scalar to backpropagate (a surrogate for the compositional losses)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Detached values worth logging (the objective's value, temperature, state statistics)."""


class ContrastiveLoss(nn.Module):
    """Base class: subclasses implement ``forward``; the hooks default to stateless no-ops.

    ``forward`` takes open_clip's outputs as they come: L2-normalised features and ``logit_scale``, the
    multiplier 1/tau (already exponentiated), plus the pairs' dataset indices. A loss whose
    ``uses_logit_bias`` is true also takes the model's ``logit_bias`` (a keyword of ``forward`` and
    ``cached_forward``: SigLIP's).
    """

    uses_logit_bias = False

    def __init__(self, gatherer: Gatherer | None = None) -> None:
        super().__init__()
        self.gatherer = gatherer or Gatherer()

    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor,
        indices: torch.Tensor,
    ) -> LossOutput:
        raise NotImplementedError

    def begin_cached_step(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor,
        indices: torch.Tensor,
        micro_batch: int,
    ) -> None:
        """Take this rank's pairs of the step (its micro-batches in order, ``micro_batch`` pairs each,
        features computed without autograd) and every rank's, for the ``cached_forward`` calls to come."""
        raise NotImplementedError(f"{type(self).__name__} has no cached step (train.contrastive_batch)")

    def cached_forward(
        self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor, micro: int
    ) -> LossOutput:
        """Micro-batch ``micro`` of this rank's step, its features live, against every pair of the step."""
        raise NotImplementedError(f"{type(self).__name__} has no cached step (train.contrastive_batch)")

    def end_cached_step(self) -> None:
        """Free what ``begin_cached_step`` kept in ``_cached`` (the staged per-sample state stays until the
        hooks)."""
        self._cached = None

    def _gather_step(self, image_features, text_features, micro_batch: int):
        """Every rank's features of the step ([G, d] each, no autograd) and where this rank's lie among
        them (rank-major, each rank's micro-batches in order)."""
        g, n = self.gatherer, image_features.shape[0]
        if n % micro_batch:
            raise ValueError(f"{n} pairs do not make micro-batches of {micro_batch}")
        # two gathers rather than one of a stacked copy: contiguous [G, d] operands, no extra G×2×d buffer
        e1_all = g.gather(image_features, purpose="features")
        e2_all = g.gather(text_features, purpose="features")
        return e1_all, e2_all, slice(g.rank * n, (g.rank + 1) * n)

    def on_step_applied(self) -> None:
        """Commit what ``forward`` staged: the optimizer step it contributed to was applied."""

    def on_step_skipped(self) -> None:
        """Discard what ``forward`` staged: the engine skipped the optimizer step."""

    def set_epoch(self, epoch: int) -> None:
        """Called at the start of every epoch (schedules of the inner rate)."""

    def save_state(self, folder: Path) -> None:
        """Write per-sample state into a checkpoint folder (every rank calls this)."""

    def load_state(self, folder: Path) -> None:
        """Read per-sample state back from a checkpoint folder."""
