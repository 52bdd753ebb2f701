"""Per-sample state of the compositional losses, sharded across ranks by dataset-index range.

Rank r of K owns the rows of indices [r·c, (r+1)·c) with c = ceil(n / K), so each rank holds n/K rows
(not n, as the reference code does): at 400M samples and 2 float32 fields that is 3.2 GB in all, spread
over every rank of the job. A step reads the rows of its B global indices with one all-reduce (owners
fill in their rows, the others add zeros) and the new rows come back through the loss's all-gather; they
are *staged* and written by their owners only when the engine applied the step (``commit``), or dropped
(``discard``). Checkpoints store each rank's range in its own file, so a job with a different number of
ranks reads back exactly the same table.
"""

from __future__ import annotations

import math
import os
import pickle
import re
from pathlib import Path

import torch

from eva_fastclip.config import ConfigError
from eva_fastclip.losses.gather import Gatherer

_FILE = re.compile(r"^per_sample_(\d{12})-(\d{12})\.pt$")


class PerSampleTable:
    """Rows of float32 ``fields`` per dataset index, this rank's index range held on CPU."""

    def __init__(self, size: int, fields: dict[str, float], gatherer: Gatherer) -> None:
        if size < 1:
            raise ValueError(f"the per-sample table needs the dataset size (got {size}); set data.index_size")
        self.size = size
        self.fields = list(fields)
        self.gatherer = gatherer
        chunk = math.ceil(size / gatherer.world_size)
        self.lo = min(size, gatherer.rank * chunk)
        self.hi = min(size, self.lo + chunk)
        initial = torch.tensor([fields[name] for name in self.fields], dtype=torch.float32)
        self.values = initial.repeat(self.hi - self.lo, 1)
        self._initial = initial
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def column(self, name: str) -> int:
        return self.fields.index(name)

    def lookup(self, indices: torch.Tensor) -> torch.Tensor:
        """Rows [len(indices), F] for indices gathered from every rank (a collective: all ranks call it)."""
        self._check_range(indices)
        owned = (indices >= self.lo) & (indices < self.hi)
        rows = torch.zeros(len(indices), len(self.fields), dtype=torch.float32)
        local = indices[owned.cpu()].cpu() - self.lo
        rows[owned.cpu()] = self.values[local]
        # owners contribute their rows, everyone else zeros: the sum is every row, on every rank
        reduced = self.gatherer.all_reduce_sum(rows.to(indices.device), purpose="state_lookup")
        return reduced

    def stage(self, indices: torch.Tensor, rows: torch.Tensor) -> None:
        """Remember new rows for ``indices`` (global, identical on every rank) until commit or discard."""
        self._pending.append((indices.detach().cpu(), rows.detach().float().cpu()))

    def commit(self) -> None:
        for indices, rows in self._pending:
            owned = (indices >= self.lo) & (indices < self.hi)
            self.values[indices[owned] - self.lo] = rows[owned]
        self._pending.clear()

    def discard(self) -> None:
        self._pending.clear()

    def local_rows(self, indices: torch.Tensor) -> torch.Tensor:
        """Rows of indices this rank owns (no collective); for tests and single-process use."""
        self._check_range(indices)
        if not bool(((indices >= self.lo) & (indices < self.hi)).all()):
            raise IndexError(f"indices outside this rank's range [{self.lo}, {self.hi})")
        return self.values[indices.cpu() - self.lo]

    def _check_range(self, indices: torch.Tensor) -> None:
        if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= self.size):
            raise IndexError(
                f"dataset index {int(indices.max())} is outside the per-sample table of {self.size} rows: "
                "the table is sized by data.index_size (or the shards' records); check the shards' indices"
            )

    # ---- checkpoints ---------------------------------------------------------------------------------

    def save(self, folder: Path) -> Path:
        """Write this rank's range to ``folder/per_sample_<lo>-<hi>.pt`` (temporary file, then rename)."""
        if self._pending:
            raise RuntimeError("per-sample state has staged rows: save only between optimizer steps")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"per_sample_{self.lo:012d}-{self.hi:012d}.pt"
        tmp = path.with_name(path.name + ".tmp")
        payload = {
            "fields": self.fields,
            "size": self.size,
            "lo": self.lo,
            "hi": self.hi,
            "values": self.values,
        }
        torch.save(payload, tmp)
        os.replace(tmp, path)
        return path

    def load(self, folder: Path) -> None:
        """Fill this rank's range from the files of any earlier world size; fails loudly on a gap."""
        covered = torch.zeros(self.hi - self.lo, dtype=torch.bool)
        for path in sorted(folder.glob("per_sample_*.pt")):
            match = _FILE.match(path.name)
            if not match:
                continue
            lo, hi = int(match.group(1)), int(match.group(2))
            start, stop = max(lo, self.lo), min(hi, self.hi)
            if start >= stop:
                continue
            try:
                payload = torch.load(path, map_location="cpu")
            except (EOFError, RuntimeError, pickle.UnpicklingError) as err:
                raise ConfigError(
                    f"{path} is truncated or damaged ({type(err).__name__}: {err}): the checkpoint's "
                    "per-sample state cannot be trusted; resume from another checkpoint (--resume FOLDER)"
                ) from None
            if payload["fields"] != self.fields or payload["size"] != self.size:
                raise ValueError(
                    f"{path} holds fields {payload['fields']} for {payload['size']} samples, but this loss "
                    f"keeps {self.fields} for {self.size}: the checkpoint is from another loss or dataset"
                )
            self.values[start - self.lo : stop - self.lo] = payload["values"][start - lo : stop - lo]
            covered[start - self.lo : stop - self.lo] = True
        if not bool(covered.all()):
            missing = int((~covered).nonzero()[0]) + self.lo
            raise FileNotFoundError(f"{folder} has no per-sample state for dataset index {missing}")
