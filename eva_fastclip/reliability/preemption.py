"""Preemption: a signal asks for a checkpoint, not a kill (Megatron's signal handler, Lightning's requeue).

SIGTERM (a scheduler's preemption, ``kill``), SIGINT (Ctrl-C), SIGHUP (a closed terminal) and
``train.preempt_signal`` (e.g. SIGUSR1 for SLURM's ``--signal``) only raise a flag. At the next
optimizer-step boundary the ranks agree on it (the trainer's one MAX all-reduce per step), save a
checkpoint of that step together and exit with :data:`PREEMPTED_EXIT_CODE`, distinct from a failure: a
scheduler or a restart loop runs the same command again with ``--resume latest``, which goes on exactly.

- The flag is raised by a thread woken by the signal itself (``signal.set_wakeup_fd``), not by a Python
  handler: those run only when the main thread gets back to Python, which a rank waiting in a collective
  does not.
- A signal may reach one rank (the others learn it at the boundary), every rank, or only a launcher.
  DeepSpeed's ``launch.py`` forwards SIGINT and SIGTERM to its ranks' whole process trees (the training
  loader's workers ignore both, so the step in flight can finish) and SIGKILLs them 30 s later. Its runner
  (the ``deepspeed`` command) on one node forwards nothing and exits at once, leaving ``launch.py`` and the
  ranks training on, orphaned; so each rank also watches the launcher that started it: a ``launch.py``
  gone, or no longer the child of the process that started it, is a preemption too.
- A second signal more than :data:`SAME_REQUEST_S` after the first (a launcher's SIGINT and then SIGTERM are
  one request) exits at once with the same code: the last complete checkpoint is intact, since a checkpoint
  is complete only once its marker is written, last (checkpointing/checkpoint.py). The hooks of
  :func:`exiting_now` run first: the run lock records the exit, which the launch supervisor returns (on
  several nodes DeepSpeed's runner itself ends with 1).
- A rank outlives its output: on several nodes the runner stops pdsh first, which closes every remote
  rank's stdout and stderr (the ssh session) before ``launch.py`` passes the SIGTERM on. The next write
  would raise BrokenPipeError out of a progress bar and end the rank without its save, so the rank's
  streams drop what they can no longer write (:func:`outlive_closed_output`).
- A step and a save must fit in the launcher's grace before SIGKILL (:data:`LAUNCHER_GRACE_S`): the trainer
  logs whether they do once it has timed both.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

#: sysexits' EX_TEMPFAIL ("a temporary failure: try again later"): the run saved a checkpoint and stopped
PREEMPTED_EXIT_CODE = 75
#: DeepSpeed's launch.py: SIGTERM to its ranks, SIGKILL this much later
LAUNCHER_GRACE_S = 30.0
#: signals closer than this to the first are the same request (a launcher's SIGINT, then its SIGTERM)
SAME_REQUEST_S = 2.0


class _Outliving(io.TextIOBase):
    """A text stream that drops its writes once its pipe is closed, instead of raising."""

    def __init__(self, stream) -> None:
        self._stream, self._gone = stream, False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except OSError as err:
                if err.errno != errno.EPIPE:  # BrokenPipeError; anything else is a real error
                    raise
                self._gone = True
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except OSError as err:
                if err.errno != errno.EPIPE:
                    raise
                self._gone = True

    def fileno(self) -> int:  # faulthandler writes the stacks there
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def __getattr__(self, name: str):  # encoding, buffer, ...: the stream's own
        return getattr(self._stream, name)


def outlive_closed_output() -> None:
    """sys.stdout, sys.stderr and the logging handlers that write to them drop writes to a closed pipe."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, _Outliving):
            continue
        setattr(sys, name, _Outliving(stream))
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is stream:
                handler.setStream(getattr(sys, name))


class Preempted(Exception):
    """The run saved a checkpoint at a step boundary and stops; the CLI exits with PREEMPTED_EXIT_CODE."""


class Preemption:
    """Within ``with Preemption(...)``: the signals and the launcher's end raise :attr:`requested`."""

    def __init__(self, extra_signal: str | None = None, *, watch_launcher: bool = True) -> None:
        self.signals = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
        if extra_signal:
            self.signals.add(signal.Signals[extra_signal])
        self.requested: str | None = None  # what asked for it, once something has
        self._first_at: float | None = None
        self._launcher = _deepspeed_launcher() if watch_launcher else None
        self._saved: dict[int, object] = {}
        self._mark = time.monotonic()
        self.step_s = 0.0  # the longest optimizer step seen (evaluations and saves left out)
        self._steps = 0  # the first one, with its one-off start-up work, does not count
        self._budget_told = False

    # ---- what a stop costs --------------------------------------------------------------------------

    def step_ended(self) -> None:
        now, self._steps = time.monotonic(), self._steps + 1
        if self._steps > 1:
            self.step_s = max(self.step_s, now - self._mark)
        self._mark = now

    def mark(self) -> None:
        """Work between steps (evaluation, a save) ended: the next step is timed from here."""
        self._mark = time.monotonic()

    def save_took(self, seconds: float) -> str | None:
        """Once, after the first save with a step timed: whether a step and a save fit in the launcher's
        grace before its SIGKILL, as a log line."""
        if self._budget_told or not self.step_s:
            return None
        self._budget_told = True
        total = self.step_s + seconds
        head = (
            f"a stop asked for finishes the optimizer step in flight and saves: {self.step_s:.1f} s + "
            f"{seconds:.1f} s = {total:.1f} s here"
        )
        if total <= LAUNCHER_GRACE_S:
            return f"{head}, within the {LAUNCHER_GRACE_S:.0f} s DeepSpeed's launcher waits before SIGKILL"
        return (
            f"{head}, more than the {LAUNCHER_GRACE_S:.0f} s DeepSpeed's launcher waits before SIGKILL: a "
            "SIGTERM through launch.py loses the work since the last checkpoint. Signal the ranks with the "
            "scheduler's warning time instead (e.g. SLURM's --signal with train.preempt_signal; "
            "docs/reliability.md)"
        )

    def __enter__(self) -> Preemption:
        read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._saved = {sig: signal.signal(sig, _ignore) for sig in self.signals}  # the thread acts on them
        self._saved_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(read,), name="preemption", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        signal.set_wakeup_fd(self._saved_fd)
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._stop.set()
        os.close(self._write)  # wakes the thread, which closes its end
        self._thread.join(timeout=5)

    def _watch(self, read: int) -> None:
        """Every signal's number arrives on ``read`` (other handled signals' too: the training loader's
        SIGCHLD handler), and once a second the launcher is looked at."""
        next_look = time.monotonic() + 1.0
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([read], [], [], max(0.0, next_look - time.monotonic()))
                if ready:
                    data = os.read(read, 64)
                    if not data:  # closed by __exit__
                        return
                    for signum in data:
                        if signum in self.signals:
                            self._signal(signal.Signals(signum).name)
                if time.monotonic() >= next_look:
                    next_look = time.monotonic() + 1.0
                    gone = (
                        self._launcher.gone() if self._launcher is not None and not self.requested else None
                    )
                    if gone:
                        self._request(gone)
        finally:
            os.close(read)

    def _signal(self, name: str) -> None:
        now = time.monotonic()
        if self._first_at is None:
            self._first_at = now
            self._request(name)
        elif now - self._first_at > SAME_REQUEST_S:
            said = f"{name} again: stopping now; the last complete checkpoint is intact"
            os.write(2, f"{said}\n".encode())
            for hook in list(_exit_now_hooks):
                with contextlib.suppress(Exception):  # nothing may keep the process from ending
                    hook(PREEMPTED_EXIT_CODE, said)
            os._exit(PREEMPTED_EXIT_CODE)

    def _request(self, what: str) -> None:
        if self.requested is None:
            self.requested = what
            log.warning("%s: a checkpoint at the end of this optimizer step, then the run stops", what)


#: called with (exit code, detail) before a second signal ends the process at once (:func:`exiting_now`)
_exit_now_hooks: list[Callable[[int, str], None]] = []


@contextlib.contextmanager
def exiting_now(hook: Callable[[int, str], None]) -> Iterator[None]:
    """Within the block, ``hook(code, detail)`` runs before a second signal ends the process with
    ``os._exit`` (no ``finally`` runs then): the run lock's release, which records the exit code."""
    _exit_now_hooks.append(hook)
    try:
        yield
    finally:
        _exit_now_hooks.remove(hook)


def _ignore(signum, frame) -> None:
    """A Python handler that does nothing: the default action (die) must not run; the thread acts."""


class _Launcher:
    """DeepSpeed's launch.py above this rank, and the process that started it."""

    def __init__(self, pid: int, parent: int) -> None:
        self.pid, self.parent = pid, parent

    def gone(self) -> str | None:
        """What became of the launcher, or None while it is as it was."""
        parent = _parent_of(self.pid)
        if parent is None:
            return f"the launcher (launch.py, pid {self.pid}) is gone"
        if parent != self.parent:
            return f"the deepspeed launcher above launch.py (pid {self.parent}) is gone"
        return None


def _deepspeed_launcher() -> _Launcher | None:
    """This rank's launch.py, when DeepSpeed's launcher started it (else nothing to watch)."""
    pid = os.getppid()
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:  # no /proc: nothing to watch
        return None
    if b"deepspeed.launcher.launch" not in command:
        return None
    parent = _parent_of(pid)
    return None if parent is None else _Launcher(pid, parent)


def _parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm)": state, ppid
