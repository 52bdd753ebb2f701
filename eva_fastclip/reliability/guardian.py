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
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time

#: after the mark, the aborting rank's own exit first: its launch.py then reports its code (124), not -9
GRACE_S = 3.0


def start_guardian(pid: int, rank: int, host: str, port: int, timeout_s: float) -> subprocess.Popen:
    """The guardian of rank ``rank`` (process ``pid``) of the run whose store is at ``host:port``."""
    command = [
        sys.executable,
        "-m",
        "eva_fastclip.reliability.guardian",
        str(pid),
        str(rank),
        host,
        str(port),
    ]
    return subprocess.Popen([*command, str(timeout_s)], stdin=subprocess.DEVNULL)


def _say(rank: int, message: str) -> None:
    print(f"guardian of rank {rank}: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eva_fastclip.reliability.guardian")
    for name, kind in (("pid", int), ("rank", int), ("host", str), ("port", int), ("timeout_s", float)):
        parser.add_argument(name, type=kind)
    args = parser.parse_args(argv)
    from eva_fastclip.reliability.signals import ignore_stop_signals
    from eva_fastclip.reliability.store import ABORT_KEY, POLL_S, store_client

    ignore_stop_signals()  # as a loader worker does: the stop signals ignored, and it dies with its rank
    if os.getppid() != args.pid:  # the rank ended before the line above
        return 0
    store, silent_since = None, None
    while True:
        time.sleep(POLL_S)
        try:
            if store is None:
                store = store_client(args.host, args.port)
            aborted = store.check([ABORT_KEY])
            why = store.get(ABORT_KEY).decode() if aborted else None
            silent_since = None
            if why:
                time.sleep(GRACE_S)
        except Exception:  # rank 0 gone or stopped
            store, why = None, None
            silent_since = silent_since or time.monotonic()
            if time.monotonic() - silent_since > args.timeout_s:
                where = f"{args.host}:{args.port}"
                why = f"the store on rank 0 ({where}) has not answered for {args.timeout_s:.0f} s"
        if why:
            # said first: once the rank dies its launch.py exits, and on another node pdsh may close the
            # output this line goes to before a line written after the kill gets there
            with contextlib.suppress(OSError):  # an output pdsh closed
                _say(args.rank, f"{why}: SIGKILL to rank {args.rank} (pid {args.pid})")
            os.kill(args.pid, signal.SIGKILL)  # its fork server and loader workers die with it
            return 0


if __name__ == "__main__":
    raise SystemExit(main())
