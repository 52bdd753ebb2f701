"""One run per ``train.remote_dir``, as reliability/run_lock.py keeps one per output folder.

Two runs on two nodes, each with its own disk, can name one remote folder (a job resubmitted while the old
one still trains elsewhere): both would copy their checkpoints there and prune each other's. So rank 0
takes ``remote_dir/run.lock`` before the run brings anything down or copies anything up, and rewrites it
with a new beat count every :data:`HEARTBEAT_S`. A run that finds a lock there watches it for
:data:`WATCH_S` by its own monotonic clock: a count that moves is a live run, and this one stops before
step 1 with one line naming it (exit code 2); a count that stands still is a dead run's (a lost node), and
its lock is taken over, logged. No clock of another host is compared. The lock goes at the run's end
(the copies done), and at the process's exit otherwise.

An object store has no atomic create that every client speaks: two runs starting within one watch of each
other can both take the lock. The run lock of a shared output folder has no such window.
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
        if found is not None:
            self._watch(found)
        self._write()
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

    def _watch(self, found: dict) -> None:
        deadline = time.monotonic() + WATCH_S
        while time.monotonic() < deadline:
            time.sleep(min(5.0, WATCH_S / 5))
            now = self._read()
            if now is None:  # given up meanwhile: the run ended
                return
            if _identity(now) != _identity(found) or now.get("beat") != found.get("beat"):
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

    def _write(self) -> None:
        self.fs.pipe_file(self.path, json.dumps(self.record).encode())


def _identity(record: dict) -> tuple:
    return record.get("host"), record.get("pid"), record.get("started")


def hold(remote_dir: str) -> None:
    """Rank 0, before anything is brought down or copied up: take ``remote_dir`` for this run."""
    if remote_dir.rstrip("/") not in _held:
        RemoteLock(remote_dir).acquire()


def give_up(remote_dir: str | None) -> None:
    """At the run's end, the copies done: give ``remote_dir`` up."""
    if remote_dir and (lock := _held.get(remote_dir.rstrip("/"))) is not None:
        lock.release()
