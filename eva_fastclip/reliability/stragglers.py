"""Stragglers: a rank whose own work is slower than the others', named with its host.

Every optimizer step ends in collectives, so every rank's step lasts as long as the slowest rank's: step
times cannot say who is slow. What a rank does alone can (NVIDIA's Resiliency Extension scores ranks the
same way): the forward of its micro-batches (no collective there with ZeRO 0-2) and its wait for its own
loader. Each rank sums both over the logging window; at the window's end one small all-gather (shared
with the data-wait figures, reliability/data_wait.py) gives every rank every rank's own seconds per step.

A rank is behind in a window when its own time per step exceeds the ranks' (lower) median by
``train.straggler_factor`` and the excess is at least MIN_SHARE of the step (below that, nobody waits for
it long enough to matter); the run's first window is left out (it holds one-off work). Behind in
``train.straggler_windows`` windows in a row, it is named in a warning on rank 0, with its host, own
time, the median, and whether its forward or its loader is slow; TensorBoard gets
``perf/straggler_ratio`` (the slowest rank's own time over the median) and ``perf/straggler_rank`` every
window. Every rank reaches the same verdict from the same figures.

On CUDA the forward is timed with CUDA events (the device's time: the host only queues the kernels); on
other devices by the clock, which the synchronous kernels make the same thing.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

#: an excess over the median below this share of the step's time is not worth a warning
MIN_SHARE = 0.02
#: after a rank was named, the next warning for it only after this many windows
WARN_AGAIN_AFTER_WINDOWS = 20


class ForwardTimer:
    """The seconds this rank spent in its forwards since the last ``take()``."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._seconds = 0.0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            start_s = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - start_s

    def take(self) -> float:
        """The seconds since the last call (on CUDA: waits for the window's last forward to finish)."""
        seconds, self._seconds = self._seconds, 0.0
        if self._events:
            self._events[-1][1].synchronize()
            seconds += sum(start.elapsed_time(end) for start, end in self._events) / 1000
            self._events = []
        return seconds


class Stragglers:
    """Each window's verdict on the ranks' own times (``factor`` 0: never warns, still measures)."""

    def __init__(self, factor: float, windows: int) -> None:
        self.factor, self.windows = factor, windows
        self._behind: dict[int, int] = {}  # rank -> windows in a row it was behind
        self._warned: dict[int, int] = {}  # rank -> windows since it was last named
        self._hosts: list[str] | None = None
        self._warmed_up = False  # the first window holds one-off work (first allocations, kernel choice)

    def end_window(
        self, forward: torch.Tensor, wait: torch.Tensor, steps: int, step_seconds: float, step: int
    ) -> tuple[dict[str, float], str | None]:
        """The window's metrics and warning (or None) from every rank's ``forward`` and data ``wait``
        seconds in the window (one value per rank), ``steps`` optimizer steps of ``step_seconds`` each.
        Every rank calls it with the same figures (it may gather the hosts' names, a collective)."""
        if steps == 0 or len(forward) < 2:  # (so the process group is up in _host_names)
            return {}, None
        own = (forward + wait) / steps
        median = float(own.median())  # the lower one of an even count: on 2 ranks, the faster rank
        slowest = int(own.argmax())
        metrics = {
            "perf/straggler_ratio": float(own[slowest]) / median if median > 0 else 1.0,
            "perf/straggler_rank": float(slowest),
        }
        warming_up, self._warmed_up = not self._warmed_up, True
        behind = [
            rank
            for rank, seconds in enumerate(own.tolist())
            if self.factor > 0
            and not warming_up
            and seconds > self.factor * median
            and seconds - median >= MIN_SHARE * step_seconds
        ]
        self._behind = {rank: self._behind.get(rank, 0) + 1 for rank in behind}
        self._warned = {rank: n + 1 for rank, n in self._warned.items() if n + 1 < WARN_AGAIN_AFTER_WINDOWS}
        named = [r for r, n in self._behind.items() if n >= self.windows and r not in self._warned]
        if not named:
            return metrics, None
        hosts = self._host_names(len(forward))
        lines = []
        for rank in named:
            self._warned[rank] = 0
            slow_forward = float(forward[rank] - forward.median()) >= float(wait[rank] - wait.median())
            lines.append(
                f"rank {rank} on {hosts[rank]}: {float(own[rank]) * 1000:.0f} ms of its own work per step "
                f"({float(forward[rank]) / steps * 1000:.0f} ms forward, "
                f"{float(wait[rank]) / steps * 1000:.0f} ms waiting for its loader) against the ranks' "
                f"median {median * 1000:.0f} ms, {self._behind[rank]} windows in a row: its "
                f"{'forward (a slow or throttled device?)' if slow_forward else 'loader (slow storage?)'} "
                "is the slow part"
            )
        text = (
            f"step {step}: straggler(s) hold every step back, the other ranks waiting for them at each "
            f"collective (train.straggler_factor={self.factor:g}): " + "; ".join(lines)
        )
        return metrics, text

    def _host_names(self, ranks: int) -> list[str]:
        """Every rank's host and node, gathered once (a collective: every rank names the same ranks)."""
        if self._hosts is None:
            # the launcher's node rank tells apart nodes that share a host name (or one host's addresses)
            mine = socket.gethostname() + (
                f" (node {os.environ['CROSS_RANK']})" if "CROSS_RANK" in os.environ else ""
            )
            if dist.is_initialized() and dist.get_world_size() > 1:
                hosts: list[str | None] = [None] * dist.get_world_size()
                dist.all_gather_object(hosts, mine)
                self._hosts = [str(h) for h in hosts]
            else:  # figures of several ranks without a process group: tests
                self._hosts = [mine] * ranks
        return self._hosts
