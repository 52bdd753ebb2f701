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

import logging
import shutil
import threading
import time
from pathlib import Path

from eva_fastclip.data.remote import Retries, url_fs

from .checkpoint import MARKER, complete_checkpoints, is_complete

log = logging.getLogger(__name__)

#: the run's logs copied after each checkpoint, from train.output_dir (a folder: all of it)
LOGS = ("config.json", "train_log.jsonl", "eval_results.jsonl", "final_metrics.json", "tensorboard")
_DOWNLOADING = ".download"


class RemoteCopy:
    """Rank 0's copies of its complete checkpoints and logs to ``remote_dir``, in the background."""

    def __init__(self, output_dir: Path, remote_dir: str, keep: int, retries: Retries | None = None) -> None:
        self.output_dir, self.remote_dir, self.keep = Path(output_dir), remote_dir.rstrip("/"), keep
        self.retries = retries or Retries()
        self.fs, self.root = url_fs(self.remote_dir)
        self._waiting: Path | None = None  # the newest checkpoint saved and not yet being copied
        self._busy = False
        self._done = threading.Condition()
        self._thread: threading.Thread | None = None
        self.copied: list[str] = []  # the tags copied whole, in order

    def checkpoint_saved(self, folder: Path) -> None:
        """Copy ``folder`` (complete) once the copy in flight is done; an older one waiting is dropped."""
        with self._done:
            self._waiting = folder
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._copy_waiting, name="remote-copy", daemon=True)
                self._thread.start()

    def finish(self) -> None:
        """Wait for the copies in flight and waiting, then copy the logs as they are now."""
        started = time.monotonic()
        with self._done:
            while self._busy or self._waiting is not None:
                self._done.wait(1.0)
        self._copy_logs()
        log.info(
            "%s: checkpoints and logs copied (%.1f s waited)", self.remote_dir, time.monotonic() - started
        )

    def _copy_waiting(self) -> None:
        while True:
            with self._done:
                folder, self._waiting = self._waiting, None
                self._busy = folder is not None
                if folder is None:
                    self._done.notify_all()
                    return
            try:
                self._copy_checkpoint(folder)
                self._copy_logs()
                self._prune()
            except Exception as err:  # noqa: BLE001 (a failed copy must not end the run: the next save tries)
                log.warning("%s: copying %s failed (%s); the next save copies again", self.remote_dir,
                            folder.name, err)  # fmt: skip
            finally:
                with self._done:
                    self._busy = False
                    self._done.notify_all()

    def _copy_checkpoint(self, folder: Path) -> None:
        target = f"{self.root}/checkpoints/{folder.name}"
        files = sorted(path for path in folder.rglob("*") if path.is_file() and path.name != MARKER)
        started = time.monotonic()
        for path in [*files, folder / MARKER]:  # the marker last: a copy cut short is never complete
            remote = f"{target}/{path.relative_to(folder).as_posix()}"
            self.retries.call(f"{self.remote_dir}: {remote}", self.fs.put_file, str(path), remote)
        self.copied.append(folder.name)
        size = sum(path.stat().st_size for path in files) / 2**20
        log.info(
            "copied %s to %s (%.0f MiB in %.1f s)", folder.name, target, size, time.monotonic() - started
        )

    def _copy_logs(self) -> None:
        for name in LOGS:
            local = self.output_dir / name
            paths = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
            for path in paths:
                if path.is_file():
                    remote = f"{self.root}/{path.relative_to(self.output_dir).as_posix()}"
                    self.retries.call(f"{self.remote_dir}: {remote}", self.fs.put_file, str(path), remote)

    def _prune(self) -> None:
        """Delete the remote checkpoints beyond the newest ``keep`` complete ones, each marker first."""
        for tag in remote_checkpoints(self.fs, self.root)[: -self.keep]:
            folder = f"{self.root}/checkpoints/{tag}"
            self.fs.rm_file(f"{folder}/{MARKER}")
            self.fs.rm(folder, recursive=True)


def remote_checkpoints(fs, root: str) -> list[str]:
    """The tags of the complete checkpoints under ``root/checkpoints``, oldest first."""
    try:
        fs.invalidate_cache(f"{root}/checkpoints")
        folders = [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(f"{root}/checkpoints", False)]
    except FileNotFoundError:
        return []
    complete = [
        tag for tag in folders if tag.startswith("step_") and fs.exists(f"{root}/checkpoints/{tag}/{MARKER}")
    ]
    return sorted(complete)


def bring_down_latest(remote_dir: str, checkpoints: Path, retries: Retries | None = None) -> Path | None:
    """Rank 0, before a ``--resume latest``: the remote's newest complete checkpoint, copied into
    ``checkpoints`` (marker last) where it is newer than the newest there; its folder, else None."""
    retries = retries or Retries()
    fs, root = url_fs(remote_dir.rstrip("/"))
    tags = remote_checkpoints(fs, root)
    local = complete_checkpoints(checkpoints)
    if not tags or (local and local[-1].name >= tags[-1]):
        return None
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
