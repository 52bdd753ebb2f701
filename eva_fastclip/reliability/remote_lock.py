"""One run per ``train.remote_dir``, as reliability/run_lock.py keeps one per output folder.

Two runs on two nodes, each with its own disk, can name one remote folder (a job resubmitted while the old
one still trains elsewhere): both would copy their checkpoints there and prune each other's. So rank 0
takes ``remote_dir/run.lock`` before the run brings anything down or copies anything up, and rewrites it
with a new beat count every :data:`HEARTBEAT_S`. A run that finds a lock there watches it for
:data:`WATCH_S` by its own monotonic clock: a count that moves is a live run, and this one stops before
step 1 with one line naming it (exit code 2); a count that stands still is a dead run's (a lost node), and
its lock is taken over, logged. No clock of another host is compared. The lock goes at the run's end
(the copies done), and at the process's exit otherwise.

The lock is only ever created where none is (S3's conditional PUT, ``If-None-Match: *``; other stores as
fsspec's ``pipe_file(mode="create")`` does it): of two runs that start at once, one creates it and the other
watches it. A takeover removes the dead run's lock right after its watch's last read of it and creates its
own, so two runs taking over one dead lock both watch it for the full watch and one of them creates the
new lock; the window left is between that read and the removal (one request), where the slower run could
remove the faster one's new lock. The run lock of a shared output folder has no such window.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time

from eva_fastclip.data.remote import url_fs
from eva_fastclip.reliability.run_lock import FolderHeld

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
HEARTBEAT_S = 30.0
WATCH_S = 2.5 * HEARTBEAT_S

_held: dict[str, RemoteLock] = {}  # remote folder -> the lock this process holds there


class RemoteLock:
    """Rank 0's hold on a remote folder."""

    def __init__(self, remote_dir: str) -> None:
        self.remote_dir = remote_dir.rstrip("/")
        self.fs, root = url_fs(self.remote_dir)
        self.path = f"{root}/{LOCK_FILE}"
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "beat": 0}
        self._stop = threading.Event()
        self._writing = threading.Lock()  # a beat in flight finishes before release removes the lock

    def acquire(self) -> None:
        """Take the folder (a dead run's lock taken over, logged); FolderHeld where a live run holds it."""
        found = self._read()
        while True:
            if found is not None and self._watch(found):  # FolderHeld where its count moves
                self.fs.rm_file(self.path)  # a dead run's, as the watch's last read found it
            try:
                self._write(create=True)
                break
            except FileExistsError:  # another run created one since this one looked: watch that
                found = self._read() or {}
        threading.Thread(target=self._beat, name="remote-run-lock", daemon=True).start()
        _held[self.remote_dir] = self
        atexit.register(self.release)

    def release(self) -> None:
        """Give the folder up (if the lock there is still this run's)."""
        if self._stop.is_set():
            return
        self._stop.set()
        _held.pop(self.remote_dir, None)
        with self._writing:
            try:
                current = self._read()
                if current is not None and _identity(current) == _identity(self.record):
                    self.fs.rm_file(self.path)
            except Exception as err:  # noqa: BLE001 (a lock left behind is taken over after a watch)
                log.warning("%s: the run lock could not be removed (%s)", self.path, err)

    def _watch(self, found: dict) -> bool:
        """Watch ``found`` for :data:`WATCH_S`: FolderHeld where its count moves, False where it is given up
        meanwhile, True where it stood still (a dead run's, still there at the last read)."""
        deadline = time.monotonic() + WATCH_S
        while time.monotonic() < deadline:
            time.sleep(min(5.0, WATCH_S / 5))
            now = self._read()
            if now is None:  # given up meanwhile: the run ended
                return False
            if _state(now) != _state(found):
                holder = f"host {now.get('host')}, pid {now.get('pid')}"
                raise FolderHeld(
                    f"train.remote_dir {self.remote_dir} is held by a live run ({holder}; "
                    f"{self.remote_dir}/{LOCK_FILE}): stop that run first, or give this one another "
                    "train.remote_dir"
                )
        log.warning(
            "taking over %s/%s from the run that held it (host %s, pid %s): no beat in %.0f s",
            self.remote_dir, LOCK_FILE, found.get("host"), found.get("pid"), WATCH_S,
        )  # fmt: skip
        return True

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with self._writing:
                if self._stop.is_set():  # released meanwhile: no beat may bring the lock back
                    return
                self.record["beat"] += 1
                try:
                    self._write()
                except Exception as err:  # noqa: BLE001 (a missed beat: the next one may go through)
                    log.warning("%s: a heartbeat of the run lock failed (%s)", self.path, err)

    def _read(self) -> dict | None:
        try:
            self.fs.invalidate_cache(self.path)
            return json.loads(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        except ValueError:  # unreadable: a dead run's half-written lock
            return {}

    def _write(self, create: bool = False) -> None:
        """The lock written: ``create`` only where none is (FileExistsError where one is)."""
        mode = "create" if create else "overwrite"
        self.fs.pipe_file(self.path, json.dumps(self.record).encode(), mode=mode)


def _identity(record: dict) -> tuple:
    return record.get("host"), record.get("pid"), record.get("started")


def _state(record: dict) -> tuple:
    """A lock's holder and beat count: what a watch compares."""
    return *_identity(record), record.get("beat")


def hold(remote_dir: str) -> None:
    """Rank 0, before anything is brought down or copied up: take ``remote_dir`` for this run."""
    if remote_dir.rstrip("/") not in _held:
        RemoteLock(remote_dir).acquire()


def give_up(remote_dir: str | None) -> None:
    """At the run's end, the copies done: give ``remote_dir`` up."""
    if remote_dir and (lock := _held.get(remote_dir.rstrip("/"))) is not None:
        lock.release()
