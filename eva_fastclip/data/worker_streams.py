"""A rank's streams of undecoded samples, one per loader worker, and how a saved position rebuilds one.

Each worker's stream of an epoch is endless, in passes: the shards (or segments of them) that
:class:`.EpochPlan` gives the worker, or shards drawn with replacement when resampled, read through a
shuffle buffer that restarts with every pass (samples of the next pass never overtake this one's).

As it goes the stream counts where it stands (:class:`Stream`): the pass, the samples handed out, the
samples of each finished shard and of the one being read. With the seeds that is all it takes to bring a
new stream to the same place (:meth:`WorkerStreams._fast_forward`): the shuffle is replayed on sample
numbers, and only the samples still in the buffer and the shard being read are read again.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .epoch_plan import EpochPlan, Segment
from .remote import Retries
from .tar_reader import FailureLog, shard_samples
from .urls import expand_urls

if TYPE_CHECKING:
    from .epoch_position import EpochPosition


class Stream:
    """Where a worker's stream of an epoch stands: the pass, the samples the shuffle buffer has handed out
    in it, the samples of each shard it finished reading in it (in reading order) and how many it has
    read of the shard it is reading. With the seeds that is all it takes to rebuild the stream there."""

    def __init__(self, pass_number: int, taken: int = 0, counts: Iterable[int] = (), read: int = 0) -> None:
        self.pass_number, self.taken, self.counts, self.read = pass_number, taken, list(counts), read

    def state(self) -> tuple[int, int, tuple[int, ...], int]:
        return self.pass_number, self.taken, tuple(self.counts), self.read


def shard_urls(
    sources: Sequence[str], weights: Sequence[float] | None, resampled: bool
) -> tuple[list[str], list[float] | None]:
    """The shards of ``sources``, and when resampled their cumulative weights (:func:`shard_cum_weights`)."""
    per_source = [expand_urls(source) for source in sources]
    urls = [url for urls in per_source for url in urls]
    if not urls:
        raise ValueError(f"no shards in {list(sources)}")
    if weights is not None and not resampled:
        raise ValueError("per-source weights need resampled=True (data.resampled)")
    return urls, shard_cum_weights(per_source, weights) if resampled else None


def shard_cum_weights(per_source: list[list[str]], weights: Sequence[float] | None) -> list[float]:
    """Cumulative per-shard weights: a source's weight is its share of draws, split over its shards."""
    if weights is None:
        return list(itertools.accumulate(1.0 for urls in per_source for _ in urls))
    if len(weights) != len(per_source) or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights {list(weights)} must be one non-negative number per source, not all zero")
    return list(itertools.accumulate(w / len(urls) for w, urls in zip(weights, per_source) for _ in urls))


class WorkerStreams:
    """The streams of one rank's loader workers: which shards each reads, shuffled and counted.

    ``cum_weights`` (from :func:`shard_cum_weights`) draws the shards of a resampled stream; ``failures``
    counts what the reader skips, and is muted while a resumed stream reads again what it had read."""

    def __init__(
        self,
        urls: list[str],
        plan: EpochPlan,
        failures: FailureLog,
        *,
        cum_weights: list[float] | None,
        seed: int,
        rank: int,
        resampled: bool,
        shuffle_buffer: int,
        retries: Retries | None = None,
    ) -> None:
        self.urls, self.plan, self.failures, self.cum_weights = urls, plan, failures, cum_weights
        self.seed, self.rank, self.resampled, self.shuffle_buffer = seed, rank, resampled, shuffle_buffer
        self.retries = retries  # a remote shard's failed requests (data/remote.py)
        # each shard's samples as its record says: what a read error cut off is counted from them
        self._counts = dict(zip(plan.urls, plan.recorded)) if plan.recorded is not None else {}

    def samples(self, epoch: int, position: EpochPosition) -> Iterator[dict[str, Any]]:
        """This rank's and worker's endless stream of undecoded samples for ``epoch``, from ``position``."""
        worker, num_workers = _worker_info()
        self.failures.start()
        # batches come round-robin from the workers: a resumed epoch's first batch is the next of the
        # worker whose turn it was, so the workers are numbered on from there
        worker = (worker + position.start) % num_workers
        resume = position.resume.get(worker)
        if self.resampled:
            salt = f":{position.offset}" if position.offset else ""
            rng = random.Random(f"resampled:{self.seed}:{epoch}:{self.rank}:{worker}{salt}")
            shards = (rng.choices(self.urls, cum_weights=self.cum_weights)[0] for _ in itertools.count())
            yield from self._pass(worker, 0, shards, rng, resume)
            return
        for pass_number in itertools.count(resume[0] if resume else 0):
            mine = self.plan.reads(epoch, pass_number, self.rank, worker, position.rest, position.offset)
            rng = random.Random(f"samples:{self.seed}:{epoch}:{pass_number}:{self.rank}:{worker}")
            yield from self._pass(worker, pass_number, iter(mine), rng, resume)
            resume = None

    def _pass(
        self, worker: int, pass_number: int, shard_urls: Iterator[str], rng: random.Random, resume
    ) -> Iterator[dict[str, Any]]:
        """One pass of a worker's stream through the shuffle buffer, from its start or from ``resume``
        (a Stream state of this pass). Each sample carries where the stream stood when it was handed out
        (``__pos__``: the state's parts, the finished shards' counts as a prefix of the growing list)."""
        stream = Stream(pass_number) if resume is None else Stream(*resume)
        buffer: list[Any] = []
        if resume is None:
            reader = self._counted(shard_urls, stream)
        else:
            reader = self._fast_forward(shard_urls, rng, stream, buffer)
        for sample in shuffle(reader, rng, self.shuffle_buffer, buffer):
            stream.taken += 1
            sample["__pos__"] = (worker, stream, stream.taken, len(stream.counts), stream.read)
            yield sample

    def _counted(self, shard_urls: Iterator[str], stream: Stream) -> Iterator[dict[str, Any]]:
        """The shards' samples, counted per shard into ``stream``."""
        for url in shard_urls:
            for sample in self._read([url]):
                stream.read += 1
                yield sample
            stream.counts.append(stream.read)
            stream.read = 0

    def _fast_forward(
        self, shard_urls: Iterator[str], rng: random.Random, stream: Stream, buffer: list[Any]
    ) -> Iterator[dict[str, Any]]:
        """Bring a pass to ``stream``'s state and return the reader that goes on from there.

        The shuffle is replayed on (shard, sample) numbers, using the counts ``stream`` holds: the same
        draws, with ``rng`` and the shard iterator (which draws from ``rng`` too when resampled), as the
        samples had. ``buffer`` is left holding the numbers of the samples it held then; those are read
        again (only they, and the current shard up to where it stood), and the reader goes on."""
        urls: list[str] = []
        current = len(stream.counts) if stream.read else None  # the shard being read, if one is

        def numbers() -> Iterator[tuple[int, int]]:
            for shard, count in enumerate(stream.counts + ([stream.read] if stream.read else [])):
                url = next(shard_urls, None)
                if url is None:
                    raise ValueError(_position_mismatch(stream, "there are fewer shards"))
                urls.append(url)
                yield from ((shard, j) for j in range(count))

        replay = shuffle(numbers(), rng, self.shuffle_buffer, buffer)
        if sum(1 for _ in itertools.islice(replay, stream.taken)) < stream.taken:
            raise ValueError(_position_mismatch(stream, "its shards hold fewer samples"))
        wanted: dict[int, dict[int, list[int]]] = {}  # shard -> sample -> places in the buffer
        for place, (shard, j) in enumerate(buffer):
            wanted.setdefault(shard, {}).setdefault(j, []).append(place)
        self.failures.muted = True  # read before the save: its problems are in the saved counts
        for shard, samples in sorted(wanted.items()):
            if shard != current:  # read up to the last sample wanted
                last, j = max(samples), -1
                for j, sample in enumerate(itertools.islice(self._read([urls[shard]]), last + 1)):
                    for place in samples.get(j, ()):
                        buffer[place] = sample
                if j < last:
                    raise ValueError(_position_mismatch(stream, f"shard {urls[shard]} holds fewer samples"))
        if current is None:
            self.failures.muted = False
            return self._counted(shard_urls, stream)
        reader = iter(self._read([urls[current]]))  # read to where it stood, and on from there
        j = -1
        for j, sample in enumerate(itertools.islice(reader, stream.read)):
            for place in wanted.get(current, {}).get(j, ()):
                buffer[place] = sample
        self.failures.muted = False
        if j + 1 < stream.read:
            raise ValueError(_position_mismatch(stream, f"shard {urls[current]} holds fewer samples"))
        return itertools.chain(self._rest_of_shard(reader, stream), self._counted(shard_urls, stream))

    def _rest_of_shard(self, reader: Iterator[dict[str, Any]], stream: Stream) -> Iterator[dict[str, Any]]:
        for sample in reader:
            stream.read += 1
            yield sample
        stream.counts.append(stream.read)
        stream.read = 0

    def _read(self, shard_urls: Iterable[str | Segment]) -> Iterator[dict[str, Any]]:
        """The samples of whole shards, or of segments (shard, first, stop) of them."""
        for item in shard_urls:
            url, first, stop = (item, 0, None) if isinstance(item, str) else item
            yield from shard_samples(url, self.failures, first, stop, self._counts.get(url), self.retries)


def shuffle(samples: Iterable[Any], rng: random.Random, size: int, buffer: list[Any]) -> Iterator[Any]:
    """A buffer shuffle: the first ``size`` samples fill ``buffer``, then each one read takes the place of
    one handed out at random, and at the end of the input the rest leave in random order. Which place is
    drawn depends only on how many samples there are, never on what they are; a ``buffer`` filled already
    continues a shuffle."""
    if size <= 1:
        yield from samples
        return
    for sample in samples:
        if len(buffer) < size:
            buffer.append(sample)
            continue
        place = rng.randrange(size)
        buffer[place], sample = sample, buffer[place]
        yield sample
    while buffer:
        place = rng.randrange(len(buffer))
        buffer[place], buffer[-1] = buffer[-1], buffer[place]
        yield buffer.pop()


def _worker_info() -> tuple[int, int]:
    """(worker id, number of workers) of the current DataLoader worker; (0, 1) in the main process."""
    info = torch.utils.data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def _position_mismatch(stream: Stream, what: str) -> str:
    return (
        f"cannot continue the epoch where it stopped (pass {stream.pass_number}, {stream.taken} samples "
        f"taken): {what} than when the checkpoint was saved. Resume with the shards the run was started on"
    )
