"""Loader worker processes keep working through a request to stop.

DeepSpeed's launch.py sends SIGTERM (after SIGINT) to every process of a rank's tree, and a scheduler's
signal may reach them all: a worker killed by it would end the step in flight with a broken loader,
while the rank itself finishes that step and saves a checkpoint (engine/preemption.py). So workers ignore
the signals that ask a run to stop, and go when their rank does (PyTorch's workers watch their parent).
"""

from __future__ import annotations

import signal

#: the signals that ask a run to stop: launchers, schedulers (SLURM's --signal), a closed terminal
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def ignore_stop_signals(worker_id: int | None = None) -> None:
    """A DataLoader ``worker_init_fn``: the stop signals ignored, and no wakeup fd shared with the rank
    (a forked worker inherits the rank's, and would report its own signals as the rank's)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.set_wakeup_fd(-1)
