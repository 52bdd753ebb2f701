"""The checkpointer: saves a run's step and restores a resumed run, a component the Trainer calls.

A checkpoint (checkpointing/checkpoint.py) holds DeepSpeed's files (weights, optimizer, schedule), the
Trainer's own small state (epoch, position in it) and the temperature controller's in the client state,
each rank's own files (per-sample state; RNG states and data position), and in its marker what the run
was: step, world size, layout, precision, config and DeepSpeed settings, recorded there once. The plan
(plan/run_plan.py) decided before anything was built whether and from where to resume, with what global
batch and precision, and what the config changes; :meth:`Checkpointer.restore` carries that out once the
engine exists: the load, what DeepSpeed does not load, the schedule over a changed length, and this run's
optimizer settings in place of the checkpoint's (checkpointing/resume_config.py).
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from eva_fastclip.checkpointing import checkpoint, resume_config
from eva_fastclip.checkpointing.remote_copy import RemoteCopy
from eva_fastclip.optim.param_groups import TEMPERATURE_GROUP
from eva_fastclip.optim.schedule import WarmupCosine, retarget_schedule
from eva_fastclip.plan.run_plan import RunPlan
from eva_fastclip.reliability import remote_lock
from eva_fastclip.reliability.process import Rank, rng_state, seed_everything, set_rng_state

log = logging.getLogger(__name__)


class Checkpointer:
    """Saves and restores a run's checkpoints under ``train.output_dir/checkpoints``."""

    def __init__(self, plan: RunPlan, rank: Rank, *, engine, loss, loader, temperature) -> None:
        self.plan, self.rank = plan, rank
        self.engine, self.loss, self.loader, self.temperature = engine, loss, loader, temperature
        self.root = Path(plan.config.train.output_dir) / "checkpoints"
        self.saved_step: int | None = None  # the step whose state is on disk (saved, or resumed unchanged)
        self.saved_at = time.monotonic()  # when that was (train.save_every_minutes counts from there)
        self.loader_position: dict[str, Any] | None = None  # the resumed epoch's data position
        # the loader's position as of the steps trained (engine/step_batches.py: not the step fetched ahead)
        self.loader_state: Callable[[], dict[str, Any] | None] | None = None
        remote_dir, keep = plan.config.train.remote_dir, plan.config.train.keep_checkpoints
        self.remote = RemoteCopy(self.root.parent, remote_dir, keep) if remote_dir and rank.is_main else None

    def folder_of(self, step: int) -> Path:
        return self.root / checkpoint.tag_for_step(step)

    # ---- saving ------------------------------------------------------------------------------------------

    def save(self, state: dict[str, int]) -> Path:
        """A checkpoint of the step in ``state`` (the Trainer's: step, epoch, micro_in_epoch); every rank."""
        plan = self.plan

        def write_extra(folder: Path) -> None:
            self.loss.save_state(folder / "per_sample")
            if self.loader_state is not None:
                position = self.loader_state()
            else:
                position = self.loader.state_dict() if hasattr(self.loader, "state_dict") else None
            checkpoint.save_rank_state(folder, self.rank.rank, {"rng": rng_state(), "loader": position})

        folder = checkpoint.save_checkpoint(
            self.engine,
            self.root,
            state["step"],
            {"epoch": state["epoch"], "micro_in_epoch": state["micro_in_epoch"], **self._temperature()},
            keep=plan.config.train.keep_checkpoints,
            write_extra=write_extra,
            marker={
                "global_batch": plan.layout.global_batch,
                "micro_batch": plan.layout.micro_batch,
                "grad_accum_steps": plan.layout.grad_accum_steps,
                "precision": plan.precision.name,
                # what a resumed run compares its own config with before it builds anything
                "config": plan.config.to_dict(),
                "deepspeed": resume_config.deepspeed_settings(plan.deepspeed),
            },
        )
        self.saved_step, self.saved_at = state["step"], time.monotonic()
        if self.remote is not None:  # copied in the background (train.remote_dir)
            self.remote.checkpoint_saved(folder)
        return folder

    def finish_copies(self, together: bool) -> None:
        """At the run's end or stop: wait for rank 0's copies to train.remote_dir, the logs included.
        ``together`` (every rank ended so): every rank waits for them, since the first rank to exit has
        DeepSpeed's launcher end the others 30 s later; not where a rank failed alone."""
        if self.remote is not None:
            try:
                self.remote.finish()
            except Exception as err:  # noqa: BLE001 (the run's own outcome stands; the copies are named)
                log.error("%s: the last copies did not go up (%s): the checkpoints copied before are whole",
                          self.remote.remote_dir, err)  # fmt: skip
            remote_lock.give_up(self.plan.config.train.remote_dir)  # the run is done with the folder
        if together and self.plan.config.train.remote_dir and self.rank.world_size > 1:
            dist.barrier()

    def _temperature(self) -> dict[str, Any]:
        return {"temperature": self.temperature.state_dict()}

    # ---- restoring ---------------------------------------------------------------------------------------

    def restore(self) -> dict[str, int]:
        """Load the plan's checkpoint and everything DeepSpeed does not load: the temperature controller,
        the per-sample state, the schedule's new length, this run's optimizer settings and, saved by as many
        ranks, this rank's RNG states and data position (the RNG states last, when nothing else draws
        before the first step). Returns the Trainer's state (step, epoch, micro_in_epoch)."""
        decision = self.plan.resume
        folder = decision.folder
        built = resume_config.optimizer_settings(self.engine.lr_scheduler)  # from this run's config
        saved = checkpoint.load_checkpoint(self.engine, folder, decision.universal)
        step = decision.marker["step"]
        state = {"step": step, "epoch": saved["epoch"], "micro_in_epoch": saved["micro_in_epoch"]}
        self.temperature.load_state_dict(saved.get("temperature", {}))
        self.loss.load_state(folder / "per_sample")
        self._retarget_schedule(step)
        self._reapply_settings(built, decision.changes)
        state["micro_in_epoch"] = self._same_samples(state["micro_in_epoch"])
        same_ranks = decision.saved_ranks == self.rank.world_size
        own = checkpoint.load_rank_state(folder, self.rank.rank) if decision.universal is None else None
        # the checkpoint's state, unchanged: no save of this step replaces the folder it came from (converted
        # from another number of ranks, the original keeps every rank's files; its conversion is reused)
        self.saved_step = step
        # on another number of ranks every rank re-tiles the epoch's rest from the same position: rank 0's
        position = own if same_ranks else checkpoint.load_rank_state(folder, 0)
        self.loader_position = position["loader"] if position else None
        if hasattr(self.loader, "load_skipped"):  # train/data/skipped* go on from the checkpoint's
            self.loader.load_skipped(self._saved_skips(own, same_ranks))
        if self.rank.is_main:
            log.info("resumed from %s at step %d (epoch %d)", folder, step, state["epoch"])
        if own is not None:
            set_rng_state(own["rng"])
        else:  # no state of this rank: fresh draws, different from the run's start and on every rank
            seed = self.plan.config.train.seed
            seed_everything(zlib.crc32(f"{seed}:{step}:{self.rank.rank}".encode()))
        return state

    def _same_samples(self, micro_in_epoch: int) -> int:
        """The micro-batches of this layout that take the samples the checkpoint's had taken in its epoch
        (micro-batches of another size: same samples)."""
        marker, layout = self.plan.resume.marker, self.plan.layout
        saved = marker.get("micro_batch", layout.micro_batch) * marker["world_size"]
        if saved == layout.samples_per_forward:
            return micro_in_epoch
        return min(micro_in_epoch * saved // layout.samples_per_forward, self.loader.num_batches)

    def _saved_skips(self, own: dict[str, Any] | None, same_ranks: bool) -> dict[str, int]:
        """This rank's part of the checkpoint's skipped-sample counts (they are logged summed over ranks):
        its own on as many ranks; on another number, rank 0 takes the sum of every saved rank's."""
        if same_ranks:
            return ((own or {}).get("loader") or {}).get("skipped", {})
        total: dict[str, int] = {}
        for rank in range(self.plan.resume.saved_ranks if self.rank.is_main else 0):
            saved = (checkpoint.load_rank_state(self.plan.resume.folder, rank) or {}).get("loader") or {}
            for reason, count in saved.get("skipped", {}).items():
                total[reason] = total.get(reason, 0) + count
        return total

    def _retarget_schedule(self, step: int) -> None:
        """Stretch the lr decay over a changed train.steps / train.epochs (optim/schedule.py), and end it at
        this run's optim.min_lr_ratio (the warm-up cannot change: checkpointing/resume_config.py)."""
        cfg, total = self.plan.config, self.plan.total_steps
        scheduler = self.engine.lr_scheduler
        saved = retarget_schedule(scheduler, step, total)
        if saved is None:
            return
        for fn in scheduler.lr_lambdas:
            if isinstance(fn, WarmupCosine):
                fn.min_ratio = cfg.optim.min_lr_ratio  # from the cosine's current point on
        if self.rank.is_main:
            _log_length_change(saved, step, total, cfg.optim.warmup_steps)

    def _reapply_settings(self, built: list[dict[str, Any]], changes) -> None:
        """The optimizer settings of this run's config in place of the checkpoint's (each group's peak lr,
        the temperature's after its one-time drop, weight decay, betas, eps), from the next step on; rank 0
        logs every key that changed (checkpointing/resume_config.py)."""
        scale = {}
        if self.temperature.lr_dropped:  # rgcl_g's drop happened: it stays on the new temperature lr
            scale[TEMPERATURE_GROUP] = self.temperature.lr_drop_factor
        resume_config.reapply_optimizer_settings(self.engine.lr_scheduler, built, scale)
        if self.rank.is_main:
            for change in changes:
                log.info("%s", change.message())


def _log_length_change(saved: WarmupCosine, step: int, total: int, warmup: int) -> None:
    if saved.warmup != warmup:  # a checkpoint that kept no config to compare
        log.warning(
            "the checkpoint's warm-up of %d steps goes on (optim.warmup_steps=%d is for new runs)",
            saved.warmup,
            warmup,
        )
    if saved.total == total:
        return
    log.info(
        "the run's length changed from %d to %d steps: the rest of the lr decay is stretched over it",
        saved.total,
        total,
    )
    if step >= saved.warmup and saved.progress(step) >= 1.0 and total > step:
        log.warning(
            "the lr had finished its decay at step %d: the %d steps added train at its final lr "
            "(optim.min_lr_ratio). To decay over the longer run, resume from a checkpoint saved before "
            "step %d",
            step,
            total - step,
            saved.total,
        )
