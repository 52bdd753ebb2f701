"""One run per output folder, and how the last run there ended.

``train.output_dir/run.lock`` names the run that holds the folder: its rank 0's host and pid, and when it
started. Rank 0 takes it before the run writes anything (engine/build.py) and gives it up when it exits,
writing first ``run_exit.json``, the exit code the run ends with (75: preempted, saved, resumable). A second
run started on a folder that a live run holds (a job resubmitted while the old one still trains) stops with
one line naming the holder and exit code 2, before it writes anything: two runs in one folder interleave
their step logs and overwrite each other's checkpoints.

A holder that died without giving the lock up (SIGKILL, a lost node, the second stop signal's ``os._exit``)
leaves a stale lock, taken over and logged:

- on the holder's own host, its pid is gone, a zombie, or another process (the start time recorded in the
  lock differs: pids are reused);
- on another host (a shared file system), its heartbeat stopped: rank 0 touches the lock every
  :data:`HEARTBEAT_S`, and one untouched for :data:`STALE_S` is stale. Generous on purpose: NFS clients may
  cache a file's times for up to a minute.

Once rank 0 holds the folder, every rank marks itself present in ``run.lock.ranks/`` (host, pid), and
marks itself leaving as it exits. The launch supervisor (reliability/supervisor.py) reads all of it: it
refuses to start a run on a folder held by a live run; after its launch it waits until every rank has
left, and on its own host until their processes have ended (on several nodes most ranks are not its
descendants); and it returns the code ``run_exit.json`` records, which DeepSpeed's runner does not pass on
when a signal ended it first.

Light on purpose: the supervisor imports it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
RANKS_DIR = "run.lock.ranks"  # rank_N.json: rank N's host and pid while it runs
EXIT_FILE = "run_exit.json"
#: how often the holder touches its lock, and how long untouched makes a lock on another host stale
HEARTBEAT_S = 10.0
STALE_S = 120.0


class FolderHeld(ValueError):
    """The output folder is held by a live run (exit code 2 through the command line)."""


@dataclass(frozen=True)
class Holder:
    """The run that holds a folder, as its lock file says."""

    host: str
    pid: int
    started: float  # time.time() when it took the lock
    process_start: int | None  # /proc/<pid>/stat's start time, to tell a reused pid
    lock: Path
    left: bool = False  # a rank's mark: it has given its part up and is exiting

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"host {self.host}, pid {self.pid}, since {since}"

    def why_stale(self) -> str | None:
        """Why this holder is dead, or None while it lives."""
        if self.host == socket.gethostname():
            start = process_start_time(self.pid)
            if start is None:
                return f"pid {self.pid} is gone"
            if self.process_start is not None and start != self.process_start:
                return f"pid {self.pid} is another process now"
            return None
        try:
            age = time.time() - self.lock.stat().st_mtime
        except FileNotFoundError:
            return "its lock is gone"
        return f"no heartbeat from {self.host} for {age:.0f} s" if age > STALE_S else None


def process_start_time(pid: int) -> int | None:
    """``pid``'s start time in clock ticks since boot, or None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        if not Path("/proc/self/stat").exists():  # no /proc: only whether the pid exists
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return None
            except PermissionError:
                pass
            return 0
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
    return None if fields[0] == "Z" else int(fields[19])


def read_holder(output_dir: Path) -> Holder | None:
    """Who holds ``output_dir``, alive or not; None when nobody does (or the lock is being written)."""
    return _read(Path(output_dir) / LOCK_FILE)


def _read(path: Path) -> Holder | None:
    try:
        record = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    fields = (record["host"], record["pid"], record["started"], record.get("process_start"), path)
    return Holder(*fields, left=bool(record.get("left")))


def running_ranks(output_dir: Path, since: float) -> list[Holder]:
    """The ranks of the run started after ``since`` (time.time()) that have not ended: alive and still
    in the run, or on this host, leaving but not yet exited (their process is looked at; on another host
    only their mark can be)."""
    found = (_read(path) for path in sorted((Path(output_dir) / RANKS_DIR).glob("rank_*.json")))
    return [
        rank
        for rank in found
        if rank is not None
        and rank.started >= since
        and (not rank.left or rank.host == socket.gethostname())
        and rank.why_stale() is None
    ]


def live_holder(output_dir: Path) -> Holder | None:
    """The live run that holds ``output_dir``, or None."""
    holder = read_holder(output_dir)
    return holder if holder is not None and holder.why_stale() is None else None


def held_message(output_dir: Path, holder: Holder) -> str:
    return (
        f"train.output_dir {output_dir} is held by a live run ({holder.describe()}; {holder.lock}): stop "
        "that run first, or give this one another train.output_dir"
    )


def read_exit(output_dir: Path, since: float) -> dict | None:
    """``run_exit.json`` when a run that ended after ``since`` (time.time()) wrote it, else None."""
    try:
        record = json.loads((Path(output_dir) / EXIT_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return record if record.get("ended", 0) >= since else None


def _record() -> dict:
    pid = os.getpid()
    started = process_start_time(pid)
    return {"host": socket.gethostname(), "pid": pid, "started": time.time(), "process_start": started}


class RunLock:
    """A rank's part in holding ``output_dir``: rank 0 takes it (:meth:`acquire`) before the run writes,
    every rank marks itself present once it is held (:meth:`join`), and each gives its part up at its exit
    (:meth:`release`: rank 0 records the exit code first)."""

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_FILE
        self._held = False
        self._present: Path | None = None
        self._stop = threading.Event()

    def acquire(self) -> None:
        """Take the folder, taking over a stale lock (logged); FolderHeld when a live run holds it."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a lost race for a stale lock is looked at again
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as out:
                json.dump(_record(), out)
            for path in (self.output_dir / RANKS_DIR).glob("*.json"):  # earlier runs' ranks, all ended
                path.unlink(missing_ok=True)
            self._held = True
            self._beat()
            return
        raise FolderHeld(f"{self.path}: not taken after 3 tries (several runs starting at once?)")

    def join(self, rank: int) -> None:
        """Mark this rank present until :meth:`release` (the folder is held by now)."""
        folder = self.output_dir / RANKS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self._present = folder / f"rank_{rank}.json"
        self._mark = _record()
        self._write_mark()
        self._beat()

    def _write_mark(self) -> None:
        tmp = self._present.with_name(f".{self._present.name}.tmp")
        tmp.write_text(json.dumps(self._mark))
        os.replace(tmp, self._present)

    def _take_over_if_stale(self) -> None:
        holder = read_holder(self.output_dir)
        if holder is None:  # being written by another run this moment, or unreadable: look again
            time.sleep(0.2)
            holder = read_holder(self.output_dir)
            if holder is None:
                if self.path.exists() and time.time() - self.path.stat().st_mtime > 5:
                    log.warning("%s is unreadable: taken over", self.path)
                    self.path.unlink(missing_ok=True)
                return
        why = holder.why_stale()
        if why is None:
            raise FolderHeld(held_message(self.output_dir, holder))
        log.warning("taking over %s from the run that held it (%s): %s", self.path, holder.describe(), why)
        self.path.unlink(missing_ok=True)

    def _beat(self) -> None:
        """The heartbeat on another host: this process's files touched every HEARTBEAT_S."""
        if not hasattr(self, "_heart"):
            self._heart = threading.Thread(target=self._heartbeat, name="run-lock", daemon=True)
            self._heart.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            for path in (self.path if self._held else None, self._present):
                if path is not None:
                    with contextlib.suppress(OSError):
                        os.utime(path)

    def release(self, code: int, detail: str = "") -> None:
        """At this rank's exit: rank 0 records how the run ends (``run_exit.json``) and gives the folder
        up; every rank leaves. Nothing where this process took no part."""
        self._stop.set()
        if self._held:
            self._held = False
            record = {"code": code, "detail": detail, "host": socket.gethostname(), "pid": os.getpid()}
            record["ended"] = time.time()
            tmp = self.output_dir / f".{EXIT_FILE}.tmp"
            with contextlib.suppress(OSError):  # a full disk must not hide the run's own error
                tmp.write_text(json.dumps(record) + "\n")
                os.replace(tmp, self.output_dir / EXIT_FILE)
            holder = read_holder(self.output_dir)
            if holder is not None and holder.pid == os.getpid() and holder.host == record["host"]:
                self.path.unlink(missing_ok=True)
        if self._present is not None:  # marked, not removed: the supervisor waits for this process's end
            self._mark["left"] = True
            with contextlib.suppress(OSError):
                self._write_mark()
            self._present = None
