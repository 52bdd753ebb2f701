"""Live tensor memory on any device, exactly: every storage an op creates, counted until it is freed.

``StorageTracker`` is a ``TorchDispatchMode`` that sees every op run inside it (forward, backward,
optimizer, collectives' output buffers). An op's output storage that is none of its inputs' storages
(so not a view and not an in-place or ``out=`` result) is new: it is counted with its size until it is
deallocated (``weakref.finalize`` on the storage: PyTorch keeps a storage's Python object while any
tensor uses it, so the finalizer runs exactly at deallocation). ``peak`` is the live sum's maximum since
the block began. Not counted: scratch that kernels allocate inside themselves, and buffers a
communication backend allocates in its own threads.

With ``limit`` it raises ``torch.OutOfMemoryError`` at the op that takes the live sum over it: what a
device with that much memory does, so ``eva-fastclip tune`` runs its out-of-memory path on a CPU
(``--memory-limit-gib``). ``python -m benchmarks.loss_memory`` measures the loss step with it.
"""

from __future__ import annotations

import os
import sys
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MIB = 2.0**20

# Python frames worth naming as the place a tensor was made (innermost first)
_WHERE = ("eva_fastclip", "open_clip", os.path.join("torch", "distributed"))


# ---- exact live-storage tracker --------------------------------------------------------------------------


@dataclass
class _Entry:
    serial: int
    nbytes: int
    op: str
    shape: tuple[int, ...]
    dtype: str
    phase: str
    where: str


def _where() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if any(part in name for part in _WHERE) and not name.endswith("tensor_memory.py"):
            return f"{_short(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "autograd"


def _short(path: str) -> str:
    for anchor in ("eva_fastclip", "open_clip", "torch"):
        i = path.rfind(os.sep + anchor + os.sep)
        if i >= 0:
            return path[i + 1 :]
    return os.path.basename(path)


class StorageTracker(TorchDispatchMode):
    """Bytes of tensor storage created inside the ``with`` block and still alive; ``peak`` is their maximum.

    Every op's outputs are inspected: a storage that is not one of the op's inputs' storages (so not a
    view or an in-place/out= result) and not already tracked is new, and counted until its deallocation.
    """

    def __init__(self, keep_peak_tensors: bool = True, limit: int | None = None) -> None:
        super().__init__()
        self.keep_peak_tensors = keep_peak_tensors
        self.limit = limit
        # storage -> entry, by its StorageImpl's address: unique while it lives, and defined for the
        # storages of fake tensors too (tune traces a model on them: no memory, the same sizes)
        self.live: dict[int, _Entry] = {}
        self.current = 0
        self.peak = 0
        self.allocated = 0  # every byte ever registered (to see churn)
        self.peak_phase = ""
        self.peak_entries: list[_Entry] = []
        self.phase = "forward"
        self._serial = 0

    def _register(self, storage: torch.UntypedStorage, op: str, t: torch.Tensor) -> None:
        self._serial += 1
        entry = _Entry(
            self._serial, storage.nbytes(), op, tuple(t.shape), str(t.dtype).replace("torch.", ""),
            self.phase, _where(),
        )  # fmt: skip
        ptr = storage._cdata
        self.live[ptr] = entry
        self.current += entry.nbytes
        self.allocated += entry.nbytes
        weakref.finalize(storage, self._release, ptr, entry.serial).atexit = False
        if self.current > self.peak:
            self.peak = self.current
            self.peak_phase = self.phase
            if self.keep_peak_tensors:
                self.peak_entries = list(self.live.values())
        if self.limit is not None and self.current > self.limit:
            # what a device of ``limit`` bytes does at the allocation that does not fit
            raise torch.OutOfMemoryError(
                f"tensor memory would reach {self.current / MIB:.1f} MiB with a {entry.op} of "
                f"{entry.nbytes / MIB:.1f} MiB ({entry.where}), over the limit of {self.limit / MIB:.1f} MiB"
            )

    def _release(self, ptr: int, serial: int) -> None:
        entry = self.live.get(ptr)
        if entry is not None and entry.serial == serial:
            del self.live[ptr]
            self.current -= entry.nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {
            x.untyped_storage()._cdata
            for x in tree_flatten((args, kwargs))[0]
            if isinstance(x, torch.Tensor) and x.device.type != "meta"
        }
        fresh_alias = func.__name__.startswith("lift_fresh")  # torch.tensor(...) data, made just before
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr = storage._cdata
            if storage.nbytes() == 0 or ptr in self.live:
                continue
            if ptr in inputs and not fresh_alias:
                continue
            self._register(storage, str(func.overloadpacket.__name__), t)
        return out

    def top_at_peak(self, n: int = 8) -> list[dict[str, Any]]:
        """The largest groups (op, shape, place) of storages live at the peak."""
        groups: dict[tuple, list[int]] = {}
        for e in self.peak_entries:
            groups.setdefault((e.op, e.shape, e.dtype, e.phase, e.where), []).append(e.nbytes)
        rows = [
            {"op": k[0], "shape": list(k[1]), "dtype": k[2], "made_in": k[3], "where": k[4],
             "count": len(v), "mib": sum(v) / MIB}
            for k, v in groups.items()
        ]  # fmt: skip
        rows.sort(key=lambda r: -r["mib"])
        return rows[:n]
