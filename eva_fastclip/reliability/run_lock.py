"""One run per output folder, and how the last run there ended.

``train.output_dir/run.lock`` names the run that holds the folder: its rank 0's host and pid, and when it
started. Rank 0 takes it before the run writes anything (engine/build.py) and gives it up when it exits,
writing first ``run_exit.json``, the exit code the run ends with (75: preempted, saved, resumable). A second
run started on a folder that a live run holds (a job resubmitted while the old one still trains) stops with
one line naming the holder and exit code 2, before it writes anything: two runs in one folder interleave
their step logs and overwrite each other's checkpoints.

A holder that died without giving the lock up (SIGKILL, a lost node, the second stop signal's ``os._exit``)
leaves a stale lock, taken over and logged:

- where its pid means what it meant to the holder (the same host, boot and PID namespace: containers
  with host networking share a host name, not their pids), its pid is gone, a zombie, or another process
  (the start time recorded in the lock differs: pids are reused);
- anywhere else (a shared file system; a replacement pod is on another host), its heartbeat stopped: the
  holder rewrites the lock with a new beat count every :data:`HEARTBEAT_S`, and a lock whose count did
  not move in :data:`WATCH_S` (this host's monotonic clock) is stale. Counts, not clocks: no decision
  compares two hosts' clocks, nor this host's clock with a file server's times.

A takeover renames the stale lock away first and checks that it renamed the holder it judged, so that of
two runs taking over at once only one holds the folder.

Once rank 0 holds the folder, every rank marks itself present in ``run.lock.ranks/`` (host, pid), and
marks itself leaving as it exits. The launch supervisor (reliability/supervisor.py) reads all of it: it
refuses to start a run on a folder held by a live run; after its launch it waits until every rank has
left, and on its own host until their processes have ended (on several nodes most ranks are not its
descendants; the marks of other hosts are judged by their beat counts, :class:`BeatWatch`); and it
returns the code ``run_exit.json`` records, which DeepSpeed's runner does not pass on
when a signal ended it first.

Light on purpose: the supervisor imports it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
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
WATCH_S = 2.5 * HEARTBEAT_S  # how long a lock from another host is watched for a beat before a takeover
UNREADABLE_S = 2.0  # how long an unreadable lock must stay unchanged to be taken over (not being written)
#: how long the supervisor waits for a mark from another host whose beat count stands still (a rank busy
#: with a save on a slow shared file system may beat late; waiting too long costs little there)
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
    beat: int = 0  # the heartbeats so far
    place: str | None = None  # where its pid means something (:func:`pid_space`); None: an older record

    @property
    def identity(self) -> tuple[str, int, float]:
        """Which run's process this is: a pid is reused, a (host, pid, start) is not."""
        return self.host, self.pid, self.started

    def same(self, other: Holder | None) -> bool:
        return other is not None and self.identity == other.identity

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"host {self.host}, pid {self.pid}, since {since}"

    @property
    def local(self) -> bool:
        """Whether its pid can be looked up here: the same host name, boot and PID namespace."""
        return self.host == socket.gethostname() and self.place in (None, pid_space())

    def why_stale(self) -> str | None:
        """Why this holder is dead as this process can tell at once (its pid), or None: alive, or only its
        beat count can tell (:class:`BeatWatch`, :func:`_no_beat`)."""
        if not self.local:
            return None if self.lock.exists() else "its lock is gone"
        start = process_start_time(self.pid)
        if start is None:
            return f"pid {self.pid} is gone"
        if self.process_start is not None and start != self.process_start:
            return f"pid {self.pid} is another process now"
        return None


@functools.cache
def pid_space() -> str:
    """Where this process's pids mean what they say: this boot of this kernel and this PID namespace."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:  # no /proc (not Linux): the host name alone
        return ""
    return f"{boot}/{namespace}"


class BeatWatch:
    """Whether the marks of other hosts live, by their beat counts seen to move on this host's monotonic
    clock: one whose count stood still for ``patience`` seconds is gone. A mark this host can look up is
    judged by its pid. One watch is kept across the reads (the supervisor polls)."""

    def __init__(self, patience: float = STALE_S) -> None:
        self.patience = patience
        self._seen: dict[tuple, tuple[int, float]] = {}  # identity -> (beat, when it was first seen)

    def alive(self, holder: Holder) -> bool:
        if holder.local:
            return holder.why_stale() is None
        now = time.monotonic()
        beat, since = self._seen.get(holder.identity, (None, now))
        if beat != holder.beat:
            self._seen[holder.identity] = (holder.beat, now)
            return True
        return now - since <= self.patience


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
    extra = {"left": bool(record.get("left")), "beat": record.get("beat", 0), "place": record.get("place")}
    return Holder(*fields, **extra)


def marks(output_dir: Path) -> list[Holder]:
    """The folder's lock and rank marks, alive or not."""
    found = [_read(path) for path in sorted((Path(output_dir) / RANKS_DIR).glob("rank_*.json"))]
    return [mark for mark in [read_holder(output_dir), *found] if mark is not None]


def running_ranks(output_dir: Path, beats: BeatWatch) -> list[Holder]:
    """The ranks that have not ended: alive and still in the run, or where their pid can be looked up,
    leaving but not yet exited (elsewhere only their mark can be read)."""
    found = (_read(path) for path in sorted((Path(output_dir) / RANKS_DIR).glob("rank_*.json")))
    return [
        rank for rank in found if rank is not None and (not rank.left or rank.local) and beats.alive(rank)
    ]


def live_holder(output_dir: Path, beats: BeatWatch) -> Holder | None:
    """The live run that holds ``output_dir``, or None."""
    holder = read_holder(output_dir)
    return holder if holder is not None and beats.alive(holder) else None


def held_here(output_dir: Path) -> Holder | None:
    """The live run on this host that holds ``output_dir``, or None. One on another host is rank 0's to
    judge (acquire() watches its heartbeat): a replacement pod must not be refused by a dead pod's lock."""
    holder = read_holder(output_dir)
    return holder if holder is not None and holder.local and holder.why_stale() is None else None


def held_message(output_dir: Path, holder: Holder) -> str:
    return (
        f"train.output_dir {output_dir} is held by a live run ({holder.describe()}; {holder.lock}): stop "
        "that run first, or give this one another train.output_dir"
    )


def read_exit(output_dir: Path) -> dict | None:
    """``run_exit.json``, or None. Which run wrote it is told by comparing it with the record read before
    a launch, not by its time (another host's clock)."""
    try:
        record = json.loads((Path(output_dir) / EXIT_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return record if isinstance(record, dict) and "code" in record else None


def _record() -> dict:
    pid = os.getpid()
    started = process_start_time(pid)
    return {"host": socket.gethostname(), "pid": pid, "started": time.time(), "process_start": started,
            "place": pid_space()}  # fmt: skip


class RunLock:
    """A rank's part in holding ``output_dir``: rank 0 takes it (:meth:`acquire`) before the run writes,
    every rank marks itself present once it is held (:meth:`join`), and each gives its part up at its exit
    (:meth:`release`: rank 0 records the exit code first)."""

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_FILE
        self._held = False
        self._created: Path | None = None  # the first folder acquire() made, if it made any
        self._files: dict[Path, dict] = {}  # this process's lock and mark, rewritten at each beat
        self._stop = threading.Event()

    def acquire(self) -> None:
        """Take the folder, taking over a stale lock (logged); FolderHeld when a live run holds it."""
        missing = [p for p in [self.output_dir, *self.output_dir.parents] if not p.exists()]
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._created = missing[-1] if missing else None
        for _ in range(3):  # a lost race for a stale lock is looked at again
            record = _record()
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as out:
                json.dump(record, out)
            for path in (self.output_dir / RANKS_DIR).glob("*.json"):  # earlier runs' ranks, all ended
                path.unlink(missing_ok=True)
            self._held = True
            self._keep(self.path, record)
            return
        raise FolderHeld(f"{self.path}: not taken after 3 tries (several runs starting at once?)")

    def join(self, rank: int) -> None:
        """Mark this rank present until :meth:`release` (the folder is held by now)."""
        folder = self.output_dir / RANKS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self._keep(folder / f"rank_{rank}.json", _record())

    def _keep(self, path: Path, record: dict) -> None:
        self._files[path] = record
        _write(path, record)
        if not hasattr(self, "_heart"):
            self._heart = threading.Thread(target=self._heartbeat, name="run-lock", daemon=True)
            self._heart.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            for path, record in list(self._files.items()):
                record["beat"] = record.get("beat", 0) + 1
                with contextlib.suppress(OSError):
                    _write(path, record)

    def _take_over_if_stale(self) -> None:
        holder = read_holder(self.output_dir)
        if holder is None:  # being written by another run this moment, or unreadable: look again
            time.sleep(0.2)
            holder = read_holder(self.output_dir)
            if holder is None:  # unreadable and unchanged for UNREADABLE_S: nobody is writing it
                with contextlib.suppress(OSError):
                    before = self.path.read_bytes()
                    time.sleep(UNREADABLE_S)
                    if read_holder(self.output_dir) is None and self.path.read_bytes() == before:
                        log.warning("%s is unreadable (%r): taken over", self.path, before[:80])
                        self.path.unlink(missing_ok=True)
                return
        why = holder.why_stale() or _no_beat(holder)
        if why is None:
            raise FolderHeld(held_message(self.output_dir, holder))
        aside = self.path.with_name(f"{LOCK_FILE}.stale.{socket.gethostname()}.{os.getpid()}")
        try:
            os.rename(self.path, aside)  # atomic: of two runs taking over, one renames the stale lock
        except FileNotFoundError:
            return
        if not holder.same(_read(aside)):  # another run took over first: its fresh lock goes back
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
            aside.unlink(missing_ok=True)
            return
        aside.unlink(missing_ok=True)
        log.warning("taking over %s from the run that held it (%s): %s", self.path, holder.describe(), why)

    def release(self, code: int, detail: str = "") -> None:
        """At this rank's exit: rank 0 records how the run ends (``run_exit.json``) and gives the folder
        up; every rank leaves. Nothing where this process took no part. A run refused by a check (exit
        code 2) leaves no folder that only acquire() made."""
        self._stop.set()
        with contextlib.suppress(OSError):  # a full disk must not hide the run's own error
            if self._held:
                self._held = False
                record = {"code": code, "detail": detail, "host": socket.gethostname(), "pid": os.getpid()}
                record["ended"] = time.time()
                _write(self.output_dir / EXIT_FILE, record)
                current, mine = _read(self.path), self._files[self.path]
                if current is not None and current.identity == (mine["host"], mine["pid"], mine["started"]):
                    self.path.unlink()  # (not a lock another run took over from this one)
            for path, record in self._files.items():
                if path != self.path:  # marked, not removed: the supervisor waits for this process's end
                    record["left"] = True
                    _write(path, record)
            self._files = {}
            if code == 2:
                self._remove_if_only_ours()

    def _remove_if_only_ours(self) -> None:
        """A run refused or stopped before it wrote anything leaves no folder it made (a config error)."""
        if self._created is None or not self.output_dir.is_dir():
            return
        ours = {LOCK_FILE, EXIT_FILE, RANKS_DIR}
        if any(p.name not in ours for p in self.output_dir.iterdir()):
            return
        shutil.rmtree(self.output_dir)
        for parent in self.output_dir.parents:  # up to the first folder that existed
            if not str(parent).startswith(str(self._created)):
                break
            with contextlib.suppress(OSError):
                parent.rmdir()


def _write(path: Path, record: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)


def _no_beat(holder: Holder) -> str | None:
    """A lock from another host: stale unless a beat comes within WATCH_S."""
    if holder.local:
        return None
    deadline = time.monotonic() + WATCH_S
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = read_holder(holder.lock.parent)
        if now is None or not holder.same(now) or now.beat != holder.beat:
            return None  # it beats (or changed hands): held
    return f"no heartbeat from {holder.host} in {WATCH_S:.0f} s"
