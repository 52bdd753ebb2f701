"""A run's set-up, in its order, written once: what every Trainer is built through.

seed → process group (reliability/process.py; the hang watchdog's heartbeats start) → the hardware every
rank shares → rank 0 takes the output folder (reliability/run_lock.py: a live run's folder stops every rank
here, before anything is written), finishes what a crash interrupted under the checkpoints, makes the plan
(plan/run_plan.py: layout, checks, precision, DeepSpeed JSON, resume decision; its errors stop every rank
before anything is built) and converts the checkpoint for this number of ranks where the plan says so →
the Trainer, built from the plan (engine/trainer.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eva_fastclip.checkpointing import checkpoint
from eva_fastclip.checkpointing.remote_copy import bring_down_latest
from eva_fastclip.config import ExperimentConfig
from eva_fastclip.engine.trainer import Trainer
from eva_fastclip.plan.precision import common_hardware, detect_hardware
from eva_fastclip.plan.run_plan import RunPlan, make_plan
from eva_fastclip.reliability import remote_lock
from eva_fastclip.reliability.process import join_process_group, on_rank0, seed_everything
from eva_fastclip.reliability.run_lock import RunLock
from eva_fastclip.reliability.watchdog import Watchdog


def build_trainer(
    cfg: ExperimentConfig,
    ds: dict[str, Any],
    *,
    resume: str | None = None,
    loader=None,
    watchdog: Watchdog | None = None,
    lock: RunLock | None = None,
) -> Trainer:
    """The Trainer of ``cfg`` and its DeepSpeed JSON ``ds`` on the ranks of this launch. ``resume``:
    ``--resume``'s value; ``loader``: a stand-in for the training shards (engine/trainer.py);
    ``watchdog``: the hang watchdog the run is under (``eva-fastclip train`` runs one); ``lock``: the
    output folder's lock, taken by rank 0 (``eva-fastclip train`` passes one and gives it up)."""
    seed_everything(cfg.train.seed)
    rank = join_process_group(watchdog)
    hardware = common_hardware(detect_hardware())  # a collective: every rank trains in one precision
    loader_batches = loader.num_batches if loader is not None else None

    def plan() -> RunPlan:
        if lock is not None:
            lock.acquire()
        if resume is not None:
            checkpoint.recover(Path(cfg.train.output_dir) / "checkpoints")
        if cfg.train.remote_dir:  # one run per remote folder too, before anything comes down or goes up
            remote_lock.hold(cfg.train.remote_dir)
        if resume == "latest" and cfg.train.remote_dir:  # a fresh node's empty folder: the remote's newest
            bring_down_latest(cfg.train.remote_dir, Path(cfg.train.output_dir) / "checkpoints")
        made = make_plan(
            cfg,
            ds,
            world_size=rank.world_size,
            hardware=hardware,
            resume=resume,
            loader_batches=loader_batches,
        )
        made.raise_for_errors()
        if made.resume is not None and made.resume.universal is not None:
            checkpoint.convert_to_universal(made.resume.folder)
        return made

    # rank 0 reads the shards' records once (minutes for LAION-400M without data.index_size) and decides;
    # its plan, or its error, reaches every rank
    made = on_rank0(plan)
    if lock is not None:  # held by now: every rank marks itself present until it exits
        lock.join(rank.rank)
    return Trainer(made, rank, loader=loader, watchdog=watchdog)
