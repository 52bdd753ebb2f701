"""The signals that ask a run to stop, and the helper processes that must not act on them.

A rank finishes its step and saves when asked to stop (reliability/preemption.py); its loader workers, its
fork server and its guardian ignore these signals and die with their parent instead (data/workers.py).
Light on purpose: the guardian process imports it.
"""

from __future__ import annotations

import ctypes
import signal
import sys

#: the signals that ask a run to stop: launchers, schedulers (SLURM's --signal), a closed terminal
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def ignore_stop_signals(worker_id: int | None = None) -> None:
    """A DataLoader ``worker_init_fn``: the stop signals ignored, and no wakeup fd shared with the rank
    (a forked worker inherits the rank's, and would report its own signals as the rank's)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.set_wakeup_fd(-1)
    die_with_parent()  # its fork server, which dies with the rank


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent ends, however it ends (SIGKILL, os._exit after a
    second stop signal): a fork server and its workers must not outlive their rank. Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def name_process(name: str) -> None:
    """Linux: the name ps, top and psutil show for this process (at most 15 bytes). Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        pr_set_name = 15
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, name.encode()[:15])
