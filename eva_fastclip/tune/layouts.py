"""The layouts a global batch can train in, and which one tune chooses.

A layout keeps the recipe (the global batch G, the model, the loss) and changes only how the ranks
hold it: the micro-batch b (so the accumulation a = G / (K·b)), what each loss evaluation sees
(``train.contrastive_batch``: b·K pairs, or with ``global`` all G of the step), gradient checkpointing
and the ZeRO stage. The objective, in this order (docs/launching.md, Tuning):

1. it fits: its peak (measured, else estimated) is within the budget, the memory limit less the margin;
2. its contrastive batch reaches the one asked for (default: the reference's, G; as large as fits);
3. the most samples per second (measured; an estimate-only plan prefers fewer forward passes, no
   recomputation and the lower ZeRO stage, in that order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

ZERO_STAGES = (0, 1, 2)


@dataclasses.dataclass(frozen=True)
class Candidate:
    micro_batch: int
    grad_accum_steps: int
    contrastive: str  # train.contrastive_batch: micro | global
    grad_checkpointing: bool
    zero_stage: int
    world_size: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum_steps * self.world_size

    @property
    def contrastive_batch(self) -> int:
        """Pairs each loss evaluation sees (config.BatchLayout.contrastive_batch)."""
        if self.contrastive == "global":
            return self.global_batch
        return self.micro_batch * self.world_size

    @property
    def option(self) -> tuple[bool, int, str]:
        """Everything but the micro-batch: the family whose sizes one memory slope describes."""
        return self.grad_checkpointing, self.zero_stage, self.contrastive

    def name(self) -> str:
        return (
            f"b={self.micro_batch} a={self.grad_accum_steps} c={self.contrastive_batch}"
            + (" (global)" if self.contrastive == "global" else "")
            + f" ckpt={'on' if self.grad_checkpointing else 'off'}"
            + f" zero={self.zero_stage}"
        )


def candidates(
    global_batch: int,
    world_size: int,
    stages: Iterable[int] = ZERO_STAGES,
    checkpointing: Iterable[bool] = (False, True),
) -> list[Candidate]:
    """Every layout of ``global_batch`` on ``world_size`` ranks: each micro-batch dividing the rank's
    share, with ``micro`` contrastive batches, and with ``global`` ones where there is accumulation (one
    micro-batch a step sees the whole step either way)."""
    share = global_batch // world_size
    found = []
    for micro in (b for b in range(1, share + 1) if share % b == 0):
        accum = share // micro
        for ckpt in checkpointing:
            for stage in stages:
                for contrastive in ("micro", "global") if accum > 1 else ("micro",):
                    found.append(Candidate(micro, accum, contrastive, ckpt, stage, world_size))
    return found


@dataclasses.dataclass
class Trial:
    """A candidate, its estimate, and what its probe measured (None: not probed)."""

    candidate: Candidate
    est_peak: int
    estimate: dict[str, int]
    peak: int | None = None
    samples_per_s: float | None = None
    data_wait: float | None = None
    oom: bool = False
    verdict: str = ""
    why: str = ""

    @property
    def known_peak(self) -> int:
        return self.peak if self.peak is not None else self.est_peak


def fits(trial: Trial, budget: int) -> bool:
    """Within the budget, by its measured peak where it was probed, else by its estimate."""
    return not trial.oom and trial.known_peak <= budget


def preference(trial: Trial, target_contrastive: int) -> tuple:
    """Sort key (smaller is better) among layouts that fit: the contrastive batch asked for, then speed
    (measured), then fewer forward passes, no recomputation, the lower ZeRO stage."""
    c = trial.candidate
    reaches = c.contrastive_batch >= target_contrastive
    speed = -(trial.samples_per_s or 0.0)
    passes = c.grad_accum_steps * (2 if c.contrastive == "global" and c.grad_accum_steps > 1 else 1)
    return (
        not reaches,
        -min(c.contrastive_batch, target_contrastive),
        speed,
        passes,
        c.grad_checkpointing,
        c.zero_stage,
    )


def largest_fitting(trials: list[Trial], budget: int) -> dict[tuple, Trial]:
    """Per option (checkpointing, stage, contrastive): the trial of the largest micro-batch that fits."""
    best: dict[tuple, Trial] = {}
    for trial in trials:
        if not fits(trial, budget):
            continue
        option = trial.candidate.option
        if option not in best or trial.candidate.micro_batch > best[option].candidate.micro_batch:
            best[option] = trial
    return best


def next_larger(trials: list[Trial], trial: Trial) -> Trial | None:
    """The trial of the same option with the next larger micro-batch (the one that should not fit)."""
    larger = [
        t
        for t in trials
        if t.candidate.option == trial.candidate.option
        and t.candidate.micro_batch > trial.candidate.micro_batch
    ]
    return min(larger, key=lambda t: t.candidate.micro_batch, default=None)


def assign_verdicts(trials: list[Trial], budget: int, target_contrastive: int) -> Trial | None:
    """Mark every trial (``chosen``, ``fits``, ``slower``, ``over_limit``, ``oom``); returns the chosen one,
    or None when nothing fits. ``slower``: probed, fits, reaches what the chosen one reaches and ran
    slower; ``fits``: fits but was not probed for speed, or sees a smaller contrastive batch."""
    fitting = [t for t in trials if fits(t, budget)]
    measured = [t for t in fitting if t.samples_per_s is not None]
    pool = measured or fitting
    chosen = min(pool, key=lambda t: preference(t, target_contrastive), default=None)
    for t in trials:
        if t.oom:
            t.verdict = "oom"
        elif not fits(t, budget):
            t.verdict = "over_limit"
            how = "measured" if t.peak is not None else "estimated"
            t.why = f"{how} {t.known_peak / 2**30:.3f} GiB > budget {budget / 2**30:.3f} GiB"
        elif t is chosen:
            t.verdict = "chosen"
        elif (
            chosen is not None
            and t.samples_per_s is not None
            and preference(t, target_contrastive)[:2] == preference(chosen, target_contrastive)[:2]
        ):
            t.verdict = "slower"
        else:
            t.verdict = "fits"
    return chosen
