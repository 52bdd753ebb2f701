"""``eva-fastclip train``: check the run before step 1, then train (exit 0, or 2/3/4/75: see ``run``)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from eva_fastclip.commands.common import add_config_args
from eva_fastclip.config import load_config

HELP = "train a CLIP model (run under the deepspeed launcher for several ranks)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument(
        "--resume", default=None, help="'latest' (newest complete checkpoint) or a checkpoint folder"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run every check before step 1 (configs, paths, lengths), print the result and the batch "
        "layout, then exit (2 if a check failed)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks to validate for with --dry-run (default: WORLD_SIZE from the launcher, else 1)",
    )


def run(args) -> int:
    """0: done; 2 (from cli.main): a check failed before step 1; 3: non-finite steps; 4: a checkpoint could
    not be written; 75 (PREEMPTED_EXIT_CODE): preempted, saved, resumable; 1: the training data could not
    be read on (saved first: DataUnavailable), or (an exception, with its traceback) anything else,
    mid-run errors included (RunFailed)."""
    from eva_fastclip.plan import preflight
    from eva_fastclip.plan.deepspeed_json import load_deepspeed_config

    cfg = load_config(args.config, args.overrides)
    ds = load_deepspeed_config(cfg.train.deepspeed_config)
    if args.dry_run:
        return dry_run(cfg, ds, args.world_size or int(os.environ.get("WORLD_SIZE", "1")), args.resume)
    # every path the run reads or writes, on every rank (each sees its own file system), before any
    # process group starts; the lengths and the resume's keys follow in the plan (engine/build.py)
    preflight.raise_for_errors(preflight.check_inputs(cfg, resume=args.resume), log_warnings=False)
    return train(cfg, ds, args.resume)


def dry_run(cfg, ds: dict, world_size: int, resume: str | None) -> int:
    """The run's plan on ``world_size`` ranks of this machine, printed; 2 (from cli.main) if a check
    failed."""
    from eva_fastclip.plan.precision import detect_hardware
    from eva_fastclip.plan.run_plan import make_plan

    plan = make_plan(cfg, ds, world_size=world_size, hardware=detect_hardware(), resume=resume)
    print(json.dumps(plan.summary(), indent=2))
    plan.raise_for_errors(log_warnings=False)
    return 0


def train(cfg, ds: dict, resume: str | None) -> int:
    """The run under the hang watchdog, holding its output folder (reliability/run_lock.py): the exit code
    is recorded in ``run_exit.json`` as the folder is given up, for the launch supervisor."""
    from pathlib import Path

    from eva_fastclip.data.workers import fork_worker_server
    from eva_fastclip.reliability.preemption import exiting_now, outlive_closed_output
    from eva_fastclip.reliability.run_lock import RunLock
    from eva_fastclip.reliability.signals import STOP_SIGNALS

    if cfg.data.workers or cfg.eval.workers:
        fork_worker_server()  # now, while this rank has one thread: forked from it (data/workers.py)
    outlive_closed_output()  # a stop on several nodes closes the output first (reliability/preemption.py)
    lock = RunLock(Path(cfg.train.output_dir))  # taken by rank 0 only (engine/build.py)
    code, detail = 1, "an unexpected error"
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}  # a preempted run ignores them
    try:
        with exiting_now(lock.release):  # a second signal's exit at once records it too
            code, detail = _train_held(cfg, ds, resume, lock)
        return code
    except RunFailed as err:  # exit code 1, the traceback on stderr: a failure the supervisor retries
        detail = str(err)
        raise
    except (ValueError, FileNotFoundError) as err:  # cli.main's exit code 2 (ConfigError is a ValueError)
        code, detail = 2, str(err)  # before step 1: _train_held turns those of a started run into RunFailed
        raise
    finally:
        lock.release(code, detail)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _train_held(cfg, ds: dict, resume: str | None, lock) -> tuple[int, str]:
    from eva_fastclip.checkpointing.checkpoint import CheckpointWriteError
    from eva_fastclip.engine.build import build_trainer
    from eva_fastclip.engine.step_batches import DataUnavailable
    from eva_fastclip.reliability.bad_steps import NonFiniteSteps
    from eva_fastclip.reliability.preemption import PREEMPTED_EXIT_CODE, Preempted
    from eva_fastclip.reliability.signals import STOP_SIGNALS
    from eva_fastclip.reliability.watchdog import Watchdog

    try:
        with Watchdog.for_run(cfg.train) as dog:
            trainer = build_trainer(cfg, ds, resume=resume, watchdog=dog, lock=lock)  # errors: exit 2
            try:
                trainer.train()
            except (ValueError, FileNotFoundError) as err:  # mid-run: not the config's, and kept whole
                raise RunFailed(f"the run failed after it started: {type(err).__name__}: {err}") from err
    except NonFiniteSteps as err:  # the last complete checkpoint is intact: say which, exit non-zero
        _say(f"stopped: {err}")
        return 3, str(err)
    except Preempted as err:  # saved at a step boundary: resumable, not a failure
        # saved: launch.py's SIGTERM, when another rank exits first, must not end this one before it
        # records the exit and gives the folder up (train()'s finally)
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        _say(f"preempted: {err}")
        return PREEMPTED_EXIT_CODE, str(err)
    except CheckpointWriteError as err:  # nothing of it left behind; the last complete one is intact
        _say(f"stopped: {err}")
        return 4, str(err)
    except DataUnavailable as err:  # saved at a step boundary; the supervisor retries (the data may return)
        _say(f"stopped: {err}")
        return 1, str(err)
    return 0, "finished"


class RunFailed(RuntimeError):
    """A ValueError or FileNotFoundError raised once training had started: not a configuration problem
    (exit code 2 means one, found before step 1, and the launch supervisor and the Kubernetes manifest do
    not retry it) but a failure, exit code 1 with its traceback, which they retry."""


def _say(line: str) -> None:
    """One line on rank 0's stderr."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"eva-fastclip train: {line}", file=sys.stderr)
