"""``train.remote_dir``: checkpoints and logs that follow the run to a fresh node.

After each complete save rank 0 copies the checkpoint to ``remote_dir/checkpoints/<tag>/`` in a thread of
its own (the steps go on), then the run's logs (``config.json``, ``train_log.jsonl``,
``eval_results.jsonl``, ``final_metrics.json``, ``tensorboard/``) to ``remote_dir/``. The marker
``COMPLETE.json`` goes up last, so a copy cut short (a kill, a lost node) is never taken for a
checkpoint; then the remote checkpoints beyond ``train.keep_checkpoints`` are deleted, each marker
first. A save that comes while a copy is in flight waits its turn, and only the newest one waiting is
copied. The run's end and a stop (preemption, data unavailable, non-finite steps) wait for the copy in
flight and the logs.

``--resume latest`` looks there too (engine/build.py): where the remote holds a complete checkpoint newer
than the output folder's (a fresh node's is empty), rank 0 brings it down, marker last, with the logs the
folder lacks (the step log goes on from them), and the run resumes from it as from its own. Files are
copied with retries (data/remote.py); credentials and the endpoint come from the environment, as for
remote shards.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

from eva_fastclip.data.remote import Retries, names_in, url_fs

from .checkpoint import MARKER, complete_checkpoints, is_complete, read_marker

log = logging.getLogger(__name__)

#: the run's logs copied after each checkpoint, from train.output_dir (a folder: all of it)
LOGS = ("config.json", "train_log.jsonl", "eval_results.jsonl", "final_metrics.json", "tensorboard")
_DOWNLOADING = ".download"
STAGING = ".remote_copy"  # in train.output_dir: hard links of the checkpoints waiting to be copied


class RemoteCopy:
    """Rank 0's copies of its complete checkpoints and logs to ``remote_dir``, in the background."""

    def __init__(self, output_dir: Path, remote_dir: str, keep: int, retries: Retries | None = None) -> None:
        self.output_dir, self.remote_dir, self.keep = Path(output_dir), remote_dir.rstrip("/"), keep
        self.retries = retries or Retries()
        self.fs, self.root = url_fs(self.remote_dir)
        # hard links of the checkpoints to copy: the local prune (train.keep_checkpoints) cannot take
        # one from under a copy in flight
        self.staging = self.output_dir / STAGING
        shutil.rmtree(self.staging, ignore_errors=True)  # an earlier process's, killed mid-copy
        self._waiting: Path | None = None  # the newest checkpoint saved and not yet being copied
        self._failed: Path | None = None  # the newest whose copy failed: copied again by finish()
        self._busy = False
        self._done = threading.Condition()
        self._thread: threading.Thread | None = None
        self.copied: list[str] = []  # the tags copied whole, in order

    def checkpoint_saved(self, folder: Path) -> None:
        """Copy ``folder`` (complete) once the copy in flight is done; an older one waiting is dropped."""
        try:
            snapshot = _linked(folder, self.staging / folder.name)
        except OSError as err:  # (rank 0 alone: this save is not copied, the run goes on)
            log.error("%s: no snapshot of %s to copy (%s); the next save is copied", self.remote_dir,
                      folder.name, err)  # fmt: skip
            return
        with self._done:
            dropped, self._waiting = self._waiting, snapshot
            if self._thread is None:
                self._thread = threading.Thread(target=self._copy_waiting, name="remote-copy", daemon=True)
                self._thread.start()
        if dropped is not None and dropped != snapshot:
            shutil.rmtree(dropped, ignore_errors=True)

    def finish(self) -> None:
        """Wait for the copies in flight and waiting, copy again one that failed, then the logs as they
        are now. Raises where the newest checkpoint still does not go up."""
        started = time.monotonic()
        with self._done:
            while self._busy or self._waiting is not None:
                self._done.wait(1.0)
        try:
            if self._failed is not None and self._failed.is_dir():
                self._copy_checkpoint(self._failed)  # the last chance: its error reaches the caller
            self._copy_logs()
        finally:
            self._failed = None
            shutil.rmtree(self.staging, ignore_errors=True)
        waited = time.monotonic() - started
        log.info("%s: checkpoints and logs copied (%.1f s waited)", self.remote_dir, waited)

    def _copy_waiting(self) -> None:
        while True:
            with self._done:
                folder, self._waiting = self._waiting, None
                self._busy = folder is not None
                if folder is None:
                    self._thread = None  # (under the lock: the next save starts a thread of its own)
                    self._done.notify_all()
                    return
            try:
                self._copy_checkpoint(folder)
            except Exception as err:  # noqa: BLE001 (a failed copy must not end the run: copied again later)
                log.warning("%s: copying %s failed (%s); the next save, or the run's end, copies again",
                            self.remote_dir, folder.name, err)  # fmt: skip
                if self._failed != folder:
                    self._forget_failed()
                self._failed = folder
            else:
                self._forget_failed()
                shutil.rmtree(folder, ignore_errors=True)
                self._after_copy()
            finally:
                with self._done:
                    self._busy = False
                    self._done.notify_all()

    def _after_copy(self) -> None:
        """The logs and the prune, after a checkpoint went up whole (a failure: named, tried next time)."""
        try:
            self._copy_logs()
            self._prune()
        except Exception as err:  # noqa: BLE001
            log.warning("%s: copying the logs or pruning failed (%s)", self.remote_dir, err)

    def _forget_failed(self) -> None:
        if self._failed is not None:
            shutil.rmtree(self._failed, ignore_errors=True)
            self._failed = None

    def _copy_checkpoint(self, folder: Path) -> None:
        target = f"{self.root}/checkpoints/{folder.name}"
        with contextlib.suppress(FileNotFoundError):  # an earlier copy of this step: its marker first
            self.fs.rm_file(f"{target}/{MARKER}")
        with contextlib.suppress(FileNotFoundError):  # then its files, some of which the new save may lack
            self.fs.rm(target, recursive=True)
        files = sorted(path for path in folder.rglob("*") if path.is_file() and path.name != MARKER)
        started = time.monotonic()
        for path in [*files, folder / MARKER]:  # the marker last: a copy cut short is never complete
            remote = f"{target}/{path.relative_to(folder).as_posix()}"
            self.retries.call(f"{self.remote_dir}: {remote}", self.fs.put_file, str(path), remote)
        self.copied.append(folder.name)
        size = sum(path.stat().st_size for path in files) / 2**20
        took = time.monotonic() - started
        log.info("copied %s to %s (%.0f MiB in %.1f s)", folder.name, target, size, took)

    def _copy_logs(self) -> None:
        for name in LOGS:
            local = self.output_dir / name
            paths = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
            for path in paths:
                if path.is_file():
                    remote = f"{self.root}/{path.relative_to(self.output_dir).as_posix()}"
                    self.retries.call(f"{self.remote_dir}: {remote}", self.fs.put_file, str(path), remote)

    def _prune(self) -> None:
        """Delete the remote checkpoints beyond the newest ``keep`` complete ones, each marker first, and
        the copies cut short (no marker: a dead run's, or this one's before a failure)."""
        complete = remote_checkpoints(self.fs, self.root)
        old = complete[: -self.keep]
        for tag in _remote_tags(self.fs, self.root):
            folder = f"{self.root}/checkpoints/{tag}"
            if tag in old:
                self.fs.rm_file(f"{folder}/{MARKER}")
            if tag in old or tag not in complete:
                self.fs.rm(folder, recursive=True)


def _linked(folder: Path, snapshot: Path) -> Path:
    """``folder``'s files at ``snapshot`` as hard links (copies where links cannot be made)."""
    if snapshot.exists():
        shutil.rmtree(snapshot)
    for path in folder.rglob("*"):
        if path.is_file():
            target = snapshot / path.relative_to(folder)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, target)
            except OSError:
                shutil.copy2(path, target)
    return snapshot


def _remote_tags(fs, root: str) -> list[str]:
    try:
        names = names_in(fs, f"{root}/checkpoints", Retries(), fresh=True)
    except FileNotFoundError:
        return []
    return [tag for tag in names if tag.startswith("step_")]


def remote_checkpoints(fs, root: str) -> list[str]:
    """The tags of the complete checkpoints under ``root/checkpoints``, oldest first: in the order their
    saves completed (their markers' ``sequence``, as locally: a rerun from an older step comes after)."""
    found = []
    for tag in _remote_tags(fs, root):
        try:
            found.append((_remote_sequence(fs, root, tag), tag))
        except FileNotFoundError:
            continue
    return [tag for _, tag in sorted(found)]


def _remote_sequence(fs, root: str, tag: str) -> int:
    marker = json.loads(fs.cat_file(f"{root}/checkpoints/{tag}/{MARKER}"))
    return marker.get("sequence", 0) if isinstance(marker, dict) else 0


def bring_down_latest(remote_dir: str, checkpoints: Path, retries: Retries | None = None) -> Path | None:
    """Rank 0, before a ``--resume latest``: the remote's newest complete checkpoint, copied into
    ``checkpoints`` (marker last) where it is newer than the newest there; its folder, else None."""
    retries = retries or Retries()
    fs, root = url_fs(remote_dir.rstrip("/"))
    tags = remote_checkpoints(fs, root)
    local = complete_checkpoints(checkpoints)
    if not tags or (
        local and read_marker(local[-1]).get("sequence", 0) >= _remote_sequence(fs, root, tags[-1])
    ):
        return None  # the output folder's newest is as new
    tag, started = tags[-1], time.monotonic()
    source, target = f"{root}/checkpoints/{tag}", checkpoints / (tag + _DOWNLOADING)
    files = [str(path) for path in fs.find(source)]
    names = [path[len(source) + 1 :] for path in files]
    for name in sorted(names, key=lambda name: name == MARKER):  # the marker last
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        retries.call(f"{remote_dir}: {source}/{name}", fs.get_file, f"{source}/{name}", str(target / name))
    if not is_complete(target):
        raise FileNotFoundError(f"{remote_dir}/checkpoints/{tag}: its {MARKER} went while it was copied")
    if (checkpoints / tag).exists():  # an incomplete one of that step (a save cut short here)
        shutil.rmtree(checkpoints / tag)
    target.rename(checkpoints / tag)
    _bring_down_logs(fs, root, checkpoints.parent, retries)
    log.warning(
        "--resume latest: brought %s down from %s (%.1f s)", tag, remote_dir, time.monotonic() - started
    )
    return checkpoints / tag


def _bring_down_logs(fs, root: str, output_dir: Path, retries: Retries) -> None:
    """The run's logs (LOGS) the output folder lacks (a fresh node's): its step log goes on from them."""
    for name in LOGS:
        source = f"{root}/{name}"
        try:
            files = [str(path) for path in fs.find(source)] if fs.isdir(source) else [source]
        except FileNotFoundError:
            continue
        for remote in files:
            local = output_dir / remote[len(root) + 1 :]
            if not local.exists() and fs.exists(remote):
                local.parent.mkdir(parents=True, exist_ok=True)
                retries.call(f"{root}: {remote}", fs.get_file, remote, str(local))
