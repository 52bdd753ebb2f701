"""Sharded checkpoints that a crash or a kill cannot corrupt.

DeepSpeed's ``save_checkpoint`` writes each rank's shards non-atomically and its ``latest`` file before
every rank is done. So every checkpoint goes into a fresh folder ``checkpoints/step_00000123`` and counts
only once our marker ``COMPLETE.json`` is in it: written by rank 0 after a barrier that every rank reaches
when its shards are on disk, through a temporary file and an atomic rename. Resume considers only marked
folders; old checkpoints are deleted only after a newer one is marked.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

MARKER = "COMPLETE.json"
_TAG = re.compile(r"^step_(\d{8,})$")


def tag_for_step(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(checkpoint: Path) -> bool:
    return (checkpoint / MARKER).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Marked checkpoint folders under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _TAG.match(p.name) and is_complete(p)]
    return sorted(found, key=lambda p: int(_TAG.match(p.name).group(1)))


def resolve_resume(resume: str | None, root: Path) -> Path | None:
    """``latest`` → newest complete checkpoint under ``root`` (None if there is none yet); a path → itself.

    A path to a checkpoint without our marker is refused: it may be a partially written save.
    """
    if resume is None:
        return None
    if resume == "latest":
        found = complete_checkpoints(root)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"--resume {resume}: no such checkpoint folder")
    if not is_complete(path):
        raise ValueError(
            f"--resume {resume}: the folder has no {MARKER}, so its save never finished (a crash or kill "
            f"during saving); resume from an earlier checkpoint, e.g. --resume latest"
        )
    return path


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON so that readers see either the old file or the whole new one, never a torn write."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    engine,
    root: Path,
    step: int,
    client_state: dict[str, Any],
    keep: int,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Every rank calls this. ``write_extra(folder)`` adds this rank's own files (per-sample state)
    before the marker. Returns the checkpoint folder once it is complete on disk."""
    tag = tag_for_step(step)
    folder = root / tag
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and folder.exists():  # a half-written save of the same step from an earlier crash
        shutil.rmtree(folder)
    _barrier()
    engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    if write_extra is not None:
        write_extra(folder)
    _barrier()  # every rank's shards are written
    if rank == 0:
        write_json_atomic(folder / MARKER, {"step": step, "tag": tag, "world_size": _world_size()})
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return folder


def load_checkpoint(engine, folder: Path) -> dict[str, Any]:
    """Load model, optimizer, scheduler and our client state from a complete checkpoint folder."""
    load_path, client_state = engine.load_checkpoint(str(folder.parent), tag=folder.name)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {folder}")
    return client_state


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
