"""A guardian beside each rank: it ends the rank once the run has ended elsewhere.

A rank stopped by SIGSTOP (a wedged GPU, a stuck file system) runs none of its threads, so its own hang
watchdog cannot end it. On its own node launch.py kills it once another rank there exits, but a node whose
every rank is stopped keeps its launch.py, and so pdsh and the ``deepspeed`` command, waiting for good.

The guardian is a small process per rank, started with the hang watchdog's store connection: every
:data:`POLL_S` seconds it asks the process group's store (served by rank 0) whether the run was aborted,
and SIGKILLs its rank (and the rank's fork server, which dies with it) when

- a rank's watchdog ended a hang and wrote :data:`ABORT_KEY` (what it saw) before exiting, or
- the store has not answered for longer than ``train.hang_timeout_s``: rank 0 is gone or stopped, so no
  collective can complete (a run that ends normally is gone long before).

It ignores the stop signals (the rank saves first: reliability/preemption.py) and dies with its rank.
Where the rank's loader fork server runs (data/workers.py), the guardian is a child of it: a fork of a
process that has torch imported (the store client needs it), not a new interpreter that imports it again
(~3 CPU-s and ~500 MB a rank). It then dies with the server, which dies with the rank.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time

#: the guardian's name in ps and top (a forked one would show its rank's command line)
PROCESS_NAME = "guardian"
#: after the mark, the aborting rank's own exit first: its launch.py then reports its code (124), not -9
GRACE_S = 3.0


def start_guardian(pid: int, rank: int, host: str, port: int, timeout_s: float):
    """The guardian of rank ``rank`` (process ``pid``) of the run whose store is at ``host:port``; what
    comes back has ``kill()`` and ``wait()``."""
    from multiprocessing import forkserver

    server_pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if server_pid is not None:
        from eva_fastclip.data.workers import worker_context

        args = (pid, rank, host, port, timeout_s, server_pid)
        process = worker_context().Process(target=watch, args=args, name=f"guardian-{rank}", daemon=True)
        process.start()
        return _ServerChild(process)
    command = [sys.executable, "-m", "eva_fastclip.reliability.guardian", str(pid), str(rank), host]
    return subprocess.Popen([*command, str(port), str(timeout_s)], stdin=subprocess.DEVNULL)


class _ServerChild:
    """A guardian started by the fork server, with a Popen's ``kill()`` and ``wait()``."""

    def __init__(self, process) -> None:
        self._process = process

    def kill(self) -> None:
        self._process.kill()

    def wait(self) -> None:
        self._process.join()


def _say(rank: int, message: str) -> None:
    print(f"guardian of rank {rank}: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eva_fastclip.reliability.guardian")
    for name, kind in (("pid", int), ("rank", int), ("host", str), ("port", int), ("timeout_s", float)):
        parser.add_argument(name, type=kind)
    args = parser.parse_args(argv)
    return watch(args.pid, args.rank, args.host, args.port, args.timeout_s, parent=args.pid)


def watch(pid: int, rank: int, host: str, port: int, timeout_s: float, parent: int) -> int:
    """Poll the store until the run is aborted or its store falls silent, then SIGKILL rank ``pid``.
    ``parent``: this process's parent (the rank, or its fork server), with which it dies."""
    from eva_fastclip.reliability.signals import ignore_stop_signals, name_process
    from eva_fastclip.reliability.store import ABORT_KEY, POLL_S, store_client

    ignore_stop_signals()  # as a loader worker does: the stop signals ignored, and it dies with its parent
    name_process(PROCESS_NAME)
    if os.getppid() != parent:  # the parent ended before the line above
        return 0
    store, silent_since = None, None
    while True:
        time.sleep(POLL_S)
        try:
            if store is None:
                store = store_client(host, port)
            aborted = store.check([ABORT_KEY])
            why = store.get(ABORT_KEY).decode() if aborted else None
            silent_since = None
            if why:
                time.sleep(GRACE_S)
        except Exception:  # rank 0 gone or stopped
            store, why = None, None
            silent_since = silent_since or time.monotonic()
            if time.monotonic() - silent_since > timeout_s:
                why = f"the store on rank 0 ({host}:{port}) has not answered for {timeout_s:.0f} s"
        if why:
            # said first: once the rank dies its launch.py exits, and on another node pdsh may close the
            # output this line goes to before a line written after the kill gets there
            with contextlib.suppress(OSError):  # an output pdsh closed
                _say(rank, f"{why}: SIGKILL to rank {rank} (pid {pid})")
            os.kill(pid, signal.SIGKILL)  # its fork server and loader workers die with it
            return 0


if __name__ == "__main__":
    raise SystemExit(main())
