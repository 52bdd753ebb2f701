"""The batch layout: micro-batch, accumulation and world size, and the global batch they make."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from eva_fastclip.config import ConfigError, ExperimentConfig, TrainConfig

#: accumulation above this many micro-batches per step is logged as a warning: every loss evaluation
#: sees a small part of the global batch, and the step is that many forward passes long
MANY_MICRO_BATCHES = 8


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """The one place where micro-batch, accumulation and world size become the global batch."""

    micro_batch: int
    grad_accum_steps: int
    world_size: int
    source: str = "train.batch_size, train.grad_accum_steps"
    """The config keys it was derived from (error messages and the DeepSpeed JSON's checks name them)."""
    contrastive: str = "micro"
    """train.contrastive_batch: what each loss evaluation sees."""

    def owners(self) -> dict[str, str]:
        """The config keys behind each size, as the DeepSpeed JSON's checks name them."""
        if self.source.startswith("train.global_batch"):
            derived = f"derived from {self.source} on {self.world_size} ranks"
            return {"micro_batch": derived, "grad_accum_steps": derived, "global_batch": "train.global_batch"}
        return {
            "micro_batch": "train.batch_size",
            "grad_accum_steps": "train.grad_accum_steps",
            "global_batch": f"train.batch_size x train.grad_accum_steps x {self.world_size} ranks",
        }

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum_steps * self.world_size

    @property
    def per_rank(self) -> int:
        """Pairs one rank contributes to an optimizer step (its share of the global batch)."""
        return self.micro_batch * self.grad_accum_steps

    @property
    def samples_per_forward(self) -> int:
        """Pairs of one forward pass across ranks (a micro-batch on every rank)."""
        return self.micro_batch * self.world_size

    @property
    def contrastive_batch(self) -> int:
        """Pairs that one loss evaluation sees across ranks (the negatives of each anchor): a forward
        pass's, or with train.contrastive_batch=global the whole step's."""
        return self.global_batch if self.contrastive == "global" else self.samples_per_forward

    @property
    def reference_contrastive_batch(self) -> int | None:
        """The contrastive batch of the reference a train.global_batch stands for: every preset's
        reference trained its global batch in one forward pass over its GPUs (no accumulation)."""
        return self.global_batch if self.source.startswith("train.global_batch") else None

    def summary(self) -> dict[str, int]:
        """What the start-up log and ``train --dry-run`` state."""
        return {
            "global_batch": self.global_batch,
            "world_size": self.world_size,
            "per_rank": self.per_rank,
            "micro_batch": self.micro_batch,
            "grad_accum_steps": self.grad_accum_steps,
            "contrastive_batch": self.contrastive_batch,
        }

    def describe(self) -> str:
        """One line for the log: global batch, its share per rank, micro-batch, accumulation, contrastive
        batch (and whether it is the reference's)."""
        if self.contrastive == "global":
            what = "the whole step's pairs: train.contrastive_batch=global"
        else:
            what = "micro-batch x ranks: train.contrastive_batch=micro"
        reference = self.reference_contrastive_batch
        if reference == self.contrastive_batch:
            what += ", the reference's"
        elif reference is not None:
            what += f"; the reference's: {reference}"
        return (
            f"global batch {self.global_batch} = {self.world_size} rank(s) x {self.per_rank} pairs "
            f"({self.grad_accum_steps} micro-batch(es) of {self.micro_batch} accumulated); each loss "
            f"evaluation sees {self.contrastive_batch} pairs (the contrastive batch: {what}); from "
            f"{self.source}"
        )

    def warnings(self) -> list[str]:
        """Why this layout deserves a second look."""
        found = []
        reference = self.reference_contrastive_batch
        if reference is not None and self.contrastive_batch < reference:
            found.append(
                f"the contrastive batch shrank to {self.contrastive_batch} pairs from the reference's "
                f"{reference}: its global batch of {self.global_batch} takes {self.grad_accum_steps} "
                f"micro-batches on each of {self.world_size} rank(s), and each loss evaluation sees one. Set "
                "train.contrastive_batch=global to train with the reference's (one more forward pass per "
                "micro-batch; docs/losses.md, Gradient accumulation)"
            )
        if self.grad_accum_steps > MANY_MICRO_BATCHES:
            found.append(
                f"{self.grad_accum_steps} micro-batches accumulated per optimizer step: each step is "
                f"{self.grad_accum_steps} forward passes long"
                + (
                    ""
                    if self.contrastive == "global"
                    else f", and each loss evaluation sees {self.contrastive_batch} of the global batch's "
                    f"{self.global_batch} pairs as negatives (docs/losses.md, Gradient accumulation)"
                )
                + "; more ranks or a larger train.max_micro_batch shorten it"
            )
        return found


def batch_layout(cfg: ExperimentConfig, world_size: int, *, resumed_global: int | None = None) -> BatchLayout:
    """Micro-batch and accumulation on ``world_size`` ranks.

    With ``train.global_batch``: each rank's share is global / ranks, and its micro-batch the share, or the
    largest divisor of the share within ``train.max_micro_batch``, accumulated share / micro times. Without
    it: ``train.batch_size`` x ``train.grad_accum_steps`` per rank, except that a run resumed on another
    number of ranks (``resumed_global``: its checkpoint's global batch) keeps its global batch by changing
    the accumulation. Every combination that cannot make the global batch is refused, naming the keys.
    """
    layout = _sizes(cfg.train, world_size, resumed_global)
    return dataclasses.replace(layout, contrastive=cfg.train.contrastive_batch)


def _sizes(train: TrainConfig, world_size: int, resumed_global: int | None) -> BatchLayout:
    if world_size < 1:
        raise ConfigError(f"the number of ranks must be >= 1, got {world_size}")
    if train.global_batch is not None:
        return _layout_for_global(train.global_batch, world_size, train.max_micro_batch)
    layout = BatchLayout(train.batch_size, train.grad_accum_steps, world_size)
    if resumed_global is None or layout.global_batch == resumed_global:
        return layout
    micro, step_pairs = train.batch_size, train.batch_size * world_size
    if resumed_global % step_pairs:
        if resumed_global % world_size:
            fix = f"resume on {_dividing(resumed_global, world_size)} ranks, which divide {resumed_global}"
        else:
            share = resumed_global // world_size
            fits = max(b for b in range(1, min(micro, share) + 1) if share % b == 0)
            fix = (
                f"set train.batch_size={fits} and train.grad_accum_steps={share // fits} (or another batch "
                f"size dividing {share}), or resume on another number of ranks"
            )
        raise ConfigError(
            f"the checkpoint's global batch of {resumed_global} cannot be made on {world_size} ranks with "
            f"train.batch_size={micro}: train.batch_size x train.grad_accum_steps x {world_size} is a "
            f"multiple of {step_pairs}, and {resumed_global} is not: {fix}"
        )
    return BatchLayout(micro, resumed_global // step_pairs, world_size)


def _layout_for_global(global_batch: int, world_size: int, max_micro: int | None) -> BatchLayout:
    source = "train.global_batch" + ("" if max_micro is None else ", train.max_micro_batch")
    if global_batch % world_size:
        near = [k * world_size for k in (global_batch // world_size, global_batch // world_size + 1) if k]
        raise ConfigError(
            f"train.global_batch={global_batch} does not divide over {world_size} ranks (every rank takes "
            f"the same share): run on {_dividing(global_batch, world_size)} ranks, or set "
            f"train.global_batch to a multiple of {world_size} (e.g. {' or '.join(map(str, near))})"
        )
    share = global_batch // world_size
    if max_micro is None or share <= max_micro:
        return BatchLayout(share, 1, world_size, source)
    fewest = math.ceil(share / max_micro)  # the accumulation a perfect divisor would need
    micro = max(b for b in range(1, max_micro + 1) if share % b == 0)
    if share // micro > 2 * fewest:
        # e.g. a prime share: micro-batches of 1, hundreds of forward passes a step
        near = share // fewest * fewest * world_size
        raise ConfigError(
            f"train.global_batch={global_batch} on {world_size} ranks is {share} pairs a rank, and the "
            f"largest micro-batch dividing {share} within train.max_micro_batch={max_micro} is {micro}: "
            f"{share // micro} forward passes a step where {fewest} would do. Set train.global_batch to "
            f"e.g. {near} ({fewest} micro-batches of {share // fewest} on each of {world_size} ranks), or "
            "run on another number of ranks"
        )
    return BatchLayout(micro, share // micro, world_size, source)


def _dividing(total: int, ranks: int) -> str:
    """The rank counts nearest ``ranks`` that divide ``total``, for error messages."""
    below = max(k for k in range(1, ranks + 1) if total % k == 0)
    above = next((k for k in range(ranks + 1, total + 1) if total % k == 0), None)
    return f"{below} or {above}" if above is not None and below != ranks else str(below)
