"""Who reads which samples of an epoch-wise epoch: every sample once, for any shards, ranks and workers.

Every rank orders the shards alike from (seed, epoch). With every shard's count known their samples line
up in one sequence, of which the first ``num_batches x batch x ranks`` make the epoch and the rest (under
one global batch) is the remainder. Each consumer (rank x loader worker) reads one range of it, as long as
its round-robin share of its rank's batches needs: rank r's block is the r-th ``num_batches x batch``
samples, its workers' ranges lie one after the other in it. The ranges tile the epoch, a shard split
between consumers where a range ends inside it (``Segment``: the reader skips the samples before its
first without decoding them).

A consumer whose range runs short (samples skipped as unusable, a shard holding fewer samples than its
record says) tops up in a second pass: its own share of the remainder, the rest of the remainder, then
the rest of the sequence, each skipped sample replaced by one drawn twice at worst.

An epoch resumed on another layout (ranks, workers, batch) re-tiles what the saved layout had not read:
``EpochRest`` orders the sequence with the samples left first, and the new consumers' ranges tile them.

Without every shard's count each consumer reads whole shards of the order (``order[c::consumers]``) and a
worker that finishes its share starts the next pass: up to a shard's worth of samples per consumer repeat
or are left out (:meth:`EpochPlan.unevenness` says how many).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

#: samples first <= number < stop of a shard (stop None: to its end), numbered as the tar reader keeps them
Segment = tuple[str, int, int | None]
#: positions low <= p < high of the epoch's sample sequence
Interval = tuple[int, int]


@dataclass(frozen=True)
class Tiling:
    """How consumers split an epoch: ranks, loader workers per rank (0: the rank's own process), micro-batch
    and batches per rank."""

    world_size: int
    workers: int
    batch_size: int
    num_batches: int

    def range(self, rank: int, worker: int, first_batch: int = 0) -> Interval:
        """Positions (in the rest's order) of the samples that ``worker`` of ``rank`` draws for the
        batches ``first_batch`` on: its batches are those whose number is ``worker`` modulo the workers."""
        workers = max(self.workers, 1)
        batches = [
            len(range(w, self.num_batches, workers)) - len(range(w, first_batch, workers))
            for w in range(workers)
        ]
        start = (rank * (self.num_batches - first_batch) + sum(batches[:worker])) * self.batch_size
        return start, start + batches[worker] * self.batch_size

    def samples(self, first_batch: int = 0) -> int:
        """Samples the batches ``first_batch`` on of every rank take."""
        return (self.num_batches - first_batch) * self.batch_size * self.world_size


@dataclass(frozen=True)
class EpochRest:
    """What an epoch has left: the batches from ``first_batch`` on tile the sequence in ``order`` (intervals
    of positions, every position once, the samples not drawn yet first); None: the sequence's own order."""

    first_batch: int = 0
    order: tuple[Interval, ...] | None = None

    def state(self) -> tuple[int, list[list[int]] | None]:
        return self.first_batch, None if self.order is None else [list(pair) for pair in self.order]

    @classmethod
    def from_state(cls, state) -> EpochRest:
        first_batch, order = state if state is not None else (0, None)
        return cls(first_batch, None if order is None else tuple((low, high) for low, high in order))


class EpochPlan:
    """The reads of every consumer of an epoch-wise epoch over ``urls``, split at sample granularity when
    ``counts`` (each shard's samples) are known and hold the epoch, else in whole shards."""

    def __init__(
        self, urls: Sequence[str], counts: Sequence[int] | None, *, seed: int, tiling: Tiling
    ) -> None:
        self.urls, self.seed, self.tiling = list(urls), seed, tiling
        self.recorded = None if counts is None else tuple(counts)
        epoch = tiling.samples()
        # counts that do not hold the epoch (a record short of data.num_samples) cannot tile it
        self.counts = self.recorded if self.recorded and sum(self.recorded) >= epoch else None
        self.total = sum(self.counts) if self.counts else None

    @property
    def by_samples(self) -> bool:
        """Whether consumers split the epoch at sample granularity (every shard counted)."""
        return self.counts is not None

    def fingerprint(self) -> int | str:
        """What the reads depend on besides the layout: a checkpoint of another plan must not go on."""
        return "whole shards" if self.counts is None else zlib.crc32(str(self.counts).encode())

    def unevenness(self, num_samples: int) -> str | None:
        """Why and by how much an epoch read in whole shards is uneven, and the fix; None where it is not."""
        if self.counts is not None:
            return None
        tiling, shards = self.tiling, len(self.urls)
        consumers = tiling.world_size * max(tiling.workers, 1)
        if self.recorded is not None:
            why = f"the shards hold {sum(self.recorded)} samples, fewer than an epoch's {tiling.samples()}"
            uneven = tiling.samples() - sum(self.recorded)
        else:
            why = "no record (manifest.json, sizes.json, *_stats.json) counts the samples of every shard"
            spare = shards % consumers  # consumers that read one shard more than the others
            uneven = (
                num_samples
                if shards < consumers
                else min(spare, consumers - spare) * math.ceil(num_samples / shards)
            )
        if not uneven:
            return None
        return (
            f"{why}: {tiling.world_size} ranks x {max(tiling.workers, 1)} loader workers read whole "
            f"shards of the {shards}, so up to about {uneven} samples an epoch repeat and as many may not "
            "be drawn. Write the counts (eva-fastclip make-shards, OpenCLIP's sizes.json) and an epoch no "
            "larger than the data to draw every sample once"
        )

    def shard_order(self, epoch: int, pass_number: int) -> list[int]:
        """The shards' order in a pass of ``epoch``: the same on every rank."""
        order = list(range(len(self.urls)))
        random.Random(f"shards:{self.seed}:{epoch}:{pass_number}").shuffle(order)
        return order

    def whole_shards_done(self, batches: int) -> int:
        """Shards of the order an approximately resumed whole-shard epoch skips after ``batches`` per rank."""
        return min(len(self.urls) - 1, batches * len(self.urls) // self.tiling.num_batches)

    def reads(
        self, epoch: int, pass_number: int, rank: int, worker: int, rest: EpochRest, shards_done: int = 0
    ) -> list[str | Segment]:
        """What ``worker`` of ``rank`` reads in pass ``pass_number`` of ``epoch``: segments of shards in
        passes 0 and 1 with every shard counted, else whole shards (pass 0 after the ``shards_done``
        skipped by an approximate resume). Pass 2 on (whole shards) only where a consumer ran short."""
        if self.counts is not None and pass_number <= 1:
            return self._segments(epoch, pass_number, rank, worker, rest)
        order = [self.urls[shard] for shard in self.shard_order(epoch, pass_number)]
        if pass_number == 0:
            order = order[shards_done:]
        consumers = self.tiling.world_size * max(self.tiling.workers, 1)
        consumer = rank * max(self.tiling.workers, 1) + worker
        # with too few shards, consumers share them rather than run dry
        return order[consumer::consumers] if len(order) >= consumers else [order[consumer % len(order)]]

    def rest_after(
        self, done: Tiling, done_rest: EpochRest, batches_done: int, first_batch: int
    ) -> EpochRest:
        """The rest of an epoch of which ``done`` (starting from ``done_rest``) drew ``batches_done``
        batches per rank, for this plan's tiling to draw from its batch ``first_batch`` on.

        Each consumer of ``done`` is taken to have drawn the start of its range, as many samples as its
        batches took: exact without a shuffle buffer and without skipped samples, else off by up to a
        shuffle buffer plus the samples it skipped. The samples left come first, in their ranges' order,
        then the remainder, then those drawn."""
        left, drawn = [], []
        workers = max(done.workers, 1)
        for rank in range(done.world_size):
            for worker in range(workers):
                start, stop = done.range(rank, worker, done_rest.first_batch)
                batches = len(range(worker, batches_done, workers)) - len(
                    range(worker, done_rest.first_batch, workers)
                )
                middle = min(stop, start + max(batches, 0) * done.batch_size)
                drawn.append((start, middle))
                left.append((middle, stop))
        order = left + [(done.samples(done_rest.first_batch), self.total)] + drawn
        global_order = [piece for low, high in order for piece in _positions(done_rest.order, low, high)]
        return EpochRest(first_batch, tuple(_merged(global_order)))

    def _segments(
        self, epoch: int, pass_number: int, rank: int, worker: int, rest: EpochRest
    ) -> list[Segment]:
        """Pass 0: the worker's range of the rest. Pass 1, the top-up: its share of the remainder, the rest
        of the remainder, the sequence after its range, then before it (a pass of its own, so that the
        shuffle buffer drains the range first)."""
        start, stop = self.tiling.range(rank, worker, rest.first_batch)
        if pass_number == 0:
            places = [(start, stop)]
        else:
            end, total = self.tiling.samples(rest.first_batch), self.total
            workers = max(self.tiling.workers, 1)
            consumer, consumers = rank * workers + worker, self.tiling.world_size * workers
            spare = end + (total - end) * consumer // consumers  # where its share of the remainder is
            places = [(spare, total), (end, spare), (stop, end), (0, start)]
        order = self.shard_order(epoch, 0)
        ends = list(itertools.accumulate(self.counts[shard] for shard in order))  # each shard's last + 1
        return [
            segment
            for low, high in places
            for interval in _positions(rest.order, low, high)
            for segment in self._shard_segments(order, ends, interval)
        ]

    def _shard_segments(self, order: list[int], ends: list[int], interval: Interval) -> list[Segment]:
        """The segments of the shards in ``order`` (which end at positions ``ends``) that hold the
        positions of ``interval``."""
        low, high = interval
        segments = []
        for place in range(bisect.bisect_right(ends, low), len(order)):
            position = ends[place] - self.counts[order[place]]  # where the shard starts
            if position >= high:
                break
            first, last = max(low, position), min(high, ends[place])
            if first < last:
                to_end = last == ends[place]  # then what follows its last sample is the segment's too
                url = self.urls[order[place]]
                segments.append((url, first - position, None if to_end else last - position))
        return segments


def _positions(order: tuple[Interval, ...] | None, low: int, high: int) -> list[Interval]:
    """The sequence positions at places ``low`` <= place < ``high`` of ``order`` (None: the sequence's
    own), as intervals."""
    if order is None:
        return [(low, high)] if low < high else []
    pieces, place = [], 0
    for start, stop in order:
        first, last = max(low, place), min(high, place + stop - start)
        if first < last:
            pieces.append((start + first - place, start + last - place))
        place += stop - start
        if place >= high:
            break
    return pieces


def _merged(intervals: list[Interval]) -> list[Interval]:
    """``intervals`` without empty ones, those that continue each other joined."""
    merged: list[Interval] = []
    for low, high in intervals:
        if low >= high:
            continue
        if merged and merged[-1][1] == low:
            merged[-1] = (merged[-1][0], high)
        else:
            merged.append((low, high))
    return merged
