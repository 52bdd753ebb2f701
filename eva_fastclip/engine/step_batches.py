"""The training loop's micro-batches, each optimizer step's fetched before the ranks agree on the step
before it: a rank whose loader cannot go on stops every rank at a step boundary, saved.

A loader that cannot go on (a remote shard still unreachable after its retries: data/remote.py) raises in
one rank's ``next()``. Raised there, the other ranks would wait for that rank in the next step's first
collective until the hang watchdog ended them, and the steps since the last checkpoint would be lost. So
the next step's micro-batches are fetched at the end of each step (:meth:`StepBatches.fetch_step`,
before the step boundary's one all-reduce), a failure is held (:attr:`failure`), and the boundary's
verdict stops every rank there: they save and the run exits naming the shard (engine/trainer.py). The
first step of each epoch is fetched before its first forward, and the ranks agree on it then
(``agree_at_start``: one all-reduce an epoch).

The loader's position saved with a checkpoint is the one after the last micro-batch handed to the loop
(:meth:`loader_state`: each batch fetched is held with the position after it), not after those fetched
ahead: a resumed run reads them again, exactly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch.distributed as dist

from eva_fastclip.data.remote import ShardUnreachable


class DataUnavailable(RuntimeError):
    """A rank's training data could not be read on: the run saved and stopped (exit code 1: retried)."""


class StepBatches:
    """Micro-batches ``accumulation`` to a step, the next step's fetched at :meth:`fetch_step`."""

    def __init__(
        self, loader: Any, accumulation: int, fetching: Callable[[], AbstractContextManager]
    ) -> None:
        """``fetching``: the hang watchdog's phase while the rank waits for its loader (the phase it was
        in comes back after: a rank that then waits for the others at the step's boundary is not named
        as waiting for its loader)."""
        self.loader, self.accumulation, self.fetching = loader, accumulation, fetching
        self.failure: str | None = None  # why this rank's loader cannot go on (one line)
        self._ahead: deque = deque()  # (batch, the loader's position after it)
        self._batches: Iterator | None = None
        self._handed: dict[str, Any] | None = None  # the position after the last batch handed out

    def epoch(self, batches: Iterable, agree_at_start: Callable[[bool], None]) -> Iterator:
        """The epoch's micro-batches: its first step's fetched here and ``agree_at_start`` told whether
        that failed (it stops the run where it failed on any rank), each next step's when the loop calls
        :meth:`fetch_step`."""
        self._batches, self._ahead = iter(batches), deque()
        self.fetch_step()
        agree_at_start(self.failure is not None)
        while self._ahead:
            batch, self._handed = self._ahead.popleft()
            yield batch

    def fetch_step(self) -> None:
        """The next optimizer step's micro-batches, fetched now (fewer at the epoch's end), each with the
        loader's position after it."""
        if self._batches is None:
            return
        with self.fetching():
            for _ in range(self.accumulation):
                try:
                    batch = next(self._batches)
                    self._ahead.append(
                        (batch, self.loader.state_dict() if hasattr(self.loader, "state_dict") else None)
                    )
                except StopIteration:
                    self._batches = None
                    return
                except ShardUnreachable as err:
                    self.failure, self._batches = _one_line(err), None
                    return

    def failures(self, world_size: int) -> str:
        """Every rank's :attr:`failure`, named by rank (a collective: every rank calls it)."""
        reasons = [self.failure]
        if world_size > 1:
            reasons = [None] * world_size
            dist.all_gather_object(reasons, self.failure)
        return "; ".join(f"rank {rank}: {why}" for rank, why in enumerate(reasons) if why)

    def loader_state(self) -> dict[str, Any] | None:
        """The loader's position after the micro-batches handed to the loop (not those fetched ahead)."""
        if self._handed is not None:
            return self._handed
        return self.loader.state_dict() if hasattr(self.loader, "state_dict") else None


def _one_line(err: Exception) -> str:
    """The error's own message: a loader worker's comes wrapped in PyTorch's account of the worker,
    its last line being ``<module>.<Class>: <message>``."""
    last = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
    name = type(err).__name__
    return last.split(f"{name}: ", 1)[1] if f"{name}: " in last else last
