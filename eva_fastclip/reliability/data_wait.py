"""How long the training steps wait on the data loader, and how many loader workers would keep up.

The loop takes its micro-batches through ``DataWait.batches``, which times every ``next()`` on the epoch's
iterator, and says when an optimizer step ended. A step's time runs from its first micro-batch's request to
its end, so evaluation, saving and logging between steps count neither as wait nor as the step's time.
Over a logging window of steps (``wall``: their seconds, ``wait``: the seconds of it spent in ``next()``):

    data wait fraction  f = wait / wall

On CUDA a step's work is queued asynchronously, but the trainer reads the loss (``.item()``) at the end of
every optimizer step, which waits for the device: a step's wall time is the device's real time, and the
wait before a step's first micro-batch is time the device sat idle. The wait before a later micro-batch of
an accumulated step may overlap work still queued from the one before: there f bounds the idle time from
above.

Workers that would keep up at the window's rates. With N >= 1 workers waiting means the loader was the
bottleneck, so it ran flat out: each worker delivers r = S / (wall N) samples/s (S: the rank's samples in
the window), and the step's own work takes c = wall - wait seconds. Keeping up takes N' r >= S / c:

    N' = ceil(N wall / c) = ceil(N / (1 - f))

With N = 0 the training process loads the samples itself, taking ``wait``; N' workers in parallel keep up
when N' >= wait / c: N' = ceil(wait / c) = ceil(f / (1 - f)). Both depend on f alone, so the slowest rank's
f (the trainer all-reduces it with MAX: that rank holds every other back at the gradient all-reduce) gives
the count for every rank. No spare worker is added: the estimate already rounds up, and the next window
shows whether it was enough.

Loader start-up: workers are not persistent, so the first request of each epoch's iterator waits for the
worker processes to start and open their first shards (and the last request of an epoch for them to
stop). Those requests are left out of the wait and of the steps' time and reported on their own as
``perf/loader_startup_seconds``: the fraction and the worker count describe the steady state.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from eva_fastclip.reliability.process import local_world_size

#: a window that waited on data longer than this share of its time gets a warning (rank 0)
WARN_ABOVE = 0.10
#: after a warning, the next only this many seconds later, unless it takes more workers than it said
WARN_AGAIN_AFTER_S = 600.0


@dataclasses.dataclass(frozen=True)
class Window:
    """One logging window of optimizer steps on one rank (or the slowest rank's, after ``slowest``)."""

    steps: int
    wall: float  # seconds the steps took, loader start-up left out
    wait: float  # seconds of ``wall`` spent waiting for micro-batches
    startup: float  # seconds the loader took to change epochs (its workers starting and stopping)

    @property
    def wait_fraction(self) -> float:
        return self.wait / self.wall if self.wall > 0 else 0.0

    def slowest(self, wall: float, wait_fraction: float, startup: float) -> Window:
        """This window with the slowest rank's wait fraction and start-up (MAX over ranks), and the
        longest wall time: each step ends in the gradient all-reduce, so they differ only by the time
        the ranks take to leave it, and every rank must decide on the same figures."""
        return dataclasses.replace(self, wall=wall, wait=wait_fraction * wall, startup=startup)


def slowest_rank(window: Window, device: torch.device, forward: float = 0.0) -> tuple[Window, torch.Tensor]:
    """``window`` with the largest wait fraction and start-up over the ranks, and every rank's own work
    in it as rows of [forward seconds, seconds waiting for the loader] (reliability/stragglers.py;
    ``forward``: this rank's). One small all-gather; every rank calls it."""
    row = torch.tensor(
        [window.wall, window.wait_fraction, window.startup, forward, window.wait], dtype=torch.float64
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        rows = [torch.empty_like(row, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row.to(device))
        ranks = torch.stack(rows).cpu()
    else:
        ranks = row[None]
    return window.slowest(*ranks[:, :3].max(dim=0).values.tolist()), ranks[:, 3:]


def workers_needed(wait_fraction: float, workers: int) -> int | None:
    """Loader workers per rank that would keep up with the steps at the measured rates (module docstring):
    ceil(N / (1 - f)) with N >= 1 workers, ceil(f / (1 - f)) with none; None when the steps did nothing but
    wait (f = 1: no rate of their own to keep up with)."""
    if wait_fraction >= 1.0:
        return None
    needed = (workers if workers > 0 else wait_fraction) / (1.0 - wait_fraction)
    return math.ceil(needed - 1e-9)  # a ratio that is whole up to rounding needs no extra worker


def cores_per_rank() -> int:
    """CPU cores this process may use, shared by the ranks on this machine (reliability/process.py)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // local_world_size())


class DataWait:
    """Measures one rank's waits on the loader; produces each window's ``perf/*`` metrics and the warning.

    ``workers``: data.workers; ``samples_per_step``: the rank's samples per optimizer step (micro-batch x
    accumulation); ``world_size``: ranks (for the global samples/s); ``clock``: seconds (tests fake it)."""

    def __init__(
        self,
        workers: int,
        samples_per_step: int,
        world_size: int,
        cores: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.workers, self.samples_per_step, self.world_size = workers, samples_per_step, world_size
        self.cores = cores
        self._clock = clock
        self._step_start: float | None = None  # the request of the step's first micro-batch
        self._step_wait = self._step_excluded = 0.0
        self._steps, self._wall, self._wait, self._startup = 0, 0.0, 0.0, 0.0
        self._warned_at: float | None = None
        self._warned_needed: int | None = None

    def batches(self, open_epoch: Callable[[], Iterable[Any]]) -> Iterator[Any]:
        """The micro-batches of ``open_epoch()``, each request timed. The epoch's opening (a DataLoader
        starts its workers there), first request and closing request count as loader start-up."""
        start = self._clock()
        iterator = iter(open_epoch())
        first = True
        while True:
            if not first:
                start = self._clock()
            try:
                batch = next(iterator)
            except StopIteration:
                self._fetched(start, self._clock(), startup=True)
                return
            self._fetched(start, self._clock(), startup=first)
            first = False
            yield batch

    def _fetched(self, start: float, end: float, startup: bool) -> None:
        if startup:
            self._startup += end - start
            if self._step_start is None:  # the step starts when its batch is there
                self._step_start = end
            else:  # a step across an epoch's end: its time leaves the change of epoch out
                self._step_excluded += end - start
            return
        if self._step_start is None:
            self._step_start = start
        self._step_wait += end - start

    def step_ended(self) -> None:
        """An optimizer step ended (after the loss was read: on CUDA the device has finished it)."""
        end = self._clock()
        if self._step_start is not None:
            self._steps += 1
            self._wall += end - self._step_start - self._step_excluded
            self._wait += self._step_wait
        self._step_start, self._step_wait, self._step_excluded = None, 0.0, 0.0

    def end_window(self) -> Window:
        """This rank's window since the last call; the next one starts empty."""
        window = Window(self._steps, self._wall, self._wait, self._startup)
        self._steps, self._wall, self._wait, self._startup = 0, 0.0, 0.0, 0.0
        return window

    def metrics(self, window: Window) -> dict[str, float]:
        """TensorBoard's ``perf/*`` for a window (log them without the ``train/`` prefix)."""
        if window.steps == 0 or window.wall <= 0:
            return {"perf/loader_startup_seconds": window.startup} if window.startup else {}
        metrics = {
            "perf/data_wait_fraction": window.wait_fraction,
            "perf/samples_per_second": window.steps * self.samples_per_step * self.world_size / window.wall,
            "perf/step_seconds": window.wall / window.steps,
        }
        if window.startup:
            metrics["perf/loader_startup_seconds"] = window.startup
        return metrics

    def warning(self, window: Window, step: int) -> str | None:
        """The warning for a window that waited on data more than WARN_ABOVE of its time, or None: the
        first such window, then one at most every WARN_AGAIN_AFTER_S seconds unless it takes more workers
        than the last warning said. ``step``: the window's last optimizer step."""
        fraction = window.wait_fraction
        if window.steps == 0 or fraction <= WARN_ABOVE:
            return None
        needed = workers_needed(fraction, self.workers)
        now = self._clock()
        worse = needed is not None and (self._warned_needed is None or needed > self._warned_needed)
        if self._warned_at is not None and now - self._warned_at < WARN_AGAIN_AFTER_S and not worse:
            return None
        self._warned_at, self._warned_needed = now, needed
        samples = window.steps * self.samples_per_step
        compute = window.wall - window.wait
        text = (
            f"steps {step - window.steps + 1}-{step}: training waited on data {fraction:.0%} of the time "
            f"(the slowest rank): the loader delivered {samples / window.wall:.1f} samples/s per rank"
        )
        if compute > 0:
            text += f", the steps' own work takes {samples / compute:.1f}"
        if self.workers == 0:
            text += ". data.workers=0 loads in the training process"
        else:
            text += f". data.workers={self.workers} per rank cannot keep up"
        if needed is None:
            return text + ": raise data.workers"
        text += f": at these rates data.workers={needed} would"
        if self.cores is not None and needed > self.cores:
            text += (
                f", more than the {self.cores} CPU cores per rank here: make the samples cheaper to decode "
                "too (smaller images in the shards)"
            )
        return text
