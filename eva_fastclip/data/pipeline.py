"""Webdataset loaders: the training stream and the ordered evaluation loaders.

The training stream is endless inside each loader worker and cut to exactly ``num_batches`` per rank and
epoch: a rank that stopped early would leave the others waiting in a collective forever.

- Epoch-wise: every rank shuffles the shard list identically from (seed, epoch). With every shard's
  count known, each rank x worker consumer reads its own range of that sample sequence in pass 0 (a shard
  split between consumers where a range ends inside it): every sample once, the remainder (under one
  global batch) left out; pass 1 tops up a consumer that ran short. Without counts, each consumer takes
  whole shards of the order, and a worker that finishes its share starts the next pass.
- Resampled: shards are drawn with replacement, weighted per source, seeded by (seed, epoch, rank, worker).

The shuffle buffer restarts with every pass, so samples of the next pass never overtake this one's.

A rank's batches come round-robin from its workers. Every batch carries where its worker's stream stands
(``_Stream``), and ``TrainLoader.state_dict`` keeps the latest of each worker: a resumed run continues the
epoch exactly where it stopped (``TrainLoader.resume``), reading again only the samples that were still
in the shuffle buffers and the shards being read, never decoding what it skips.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import io
import itertools
import json
import logging
import math
import multiprocessing
import os
import random
import re
import tarfile
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import braceexpand
import PIL.Image
import torch
import webdataset as wds
from torch import Tensor
from torch.utils.data import DataLoader
from webdataset.tariterators import base_plus_ext

from .shards import MANIFEST_NAME, read_manifest
from .sizes import is_remote, resolve_sizes

logger = logging.getLogger(__name__)

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
_IMAGE_FIELD = ";".join(IMAGE_KEYS)  # webdataset's "first of these keys" syntax
_MAX_FAILURES_IN_A_ROW = 1000
#: how a zero-shot prompt template marks the class name: clip_benchmark's "{c}", or "{}"
TEMPLATE_PLACEHOLDERS = ("{c}", "{}")
_WARNINGS_PER_PROCESS = 10
#: samples first <= number < stop of a shard (stop None: to its end), numbered as TrainLoader keeps them
Segment = tuple[str, int, int | None]
_META_MEMBER = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata files: not part of any sample

Preprocess = Callable[[PIL.Image.Image], Tensor]
Tokenize = Callable[[list[str]], Tensor]


def expand_urls(patterns: str | Sequence[str]) -> list[str]:
    """Shard URLs from brace patterns ("dir/shard-{000000..000007}.tar"), "::"-joined lists and folders.

    A folder expands to the shards its manifest.json lists (or, without one of ours, its ``*.tar`` files).
    Local paths must exist: a typo fails here with FileNotFoundError, not later inside a loader worker.
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    urls: list[str] = []
    for pattern in patterns:
        for part in pattern.split("::"):
            if part.strip():
                urls.extend(_expand_pattern(part.strip()))
    return urls


def _expand_pattern(pattern: str) -> list[str]:
    if is_remote(pattern):
        return list(braceexpand.braceexpand(pattern))
    if os.path.isdir(pattern):
        return _shards_in_folder(pattern)
    urls = list(braceexpand.braceexpand(pattern))
    _require_files(urls, f"shard pattern {pattern!r}")
    return urls


def _shards_in_folder(folder: str) -> list[str]:
    manifest = read_manifest(folder)
    if manifest is not None:
        urls = [os.path.join(folder, name) for name in manifest["shards"]]
        _require_files(urls, f"{os.path.join(folder, MANIFEST_NAME)}")
    else:
        if os.path.isfile(os.path.join(folder, MANIFEST_NAME)):
            logger.info(
                "%s: its %s is another tool's, not eva_fastclip's: reading the folder's *.tar files",
                folder,
                MANIFEST_NAME,
            )
        urls = sorted(glob.glob(os.path.join(glob.escape(folder), "*.tar")))
    if not urls:
        raise FileNotFoundError(
            f"{folder}: no shards (neither a manifest.json listing shards nor *.tar files)"
        )
    return urls


def _require_files(paths: list[str], origin: str) -> None:
    missing = [path for path in paths if not os.path.isfile(path)]
    if missing:
        raise FileNotFoundError(
            f"{origin}: {len(missing)} of {len(paths)} shards do not exist (first: {missing[0]})"
        )


def _worker_info() -> tuple[int, int]:
    """(worker id, number of workers) of the current DataLoader worker; (0, 1) in the main process."""
    info = torch.utils.data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def _first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0].strip()


def parse_index(value: Any) -> int | None:
    """A dataset index from a .json field: an integer or a string of digits (img2dataset's "000010005",
    read as FastCLIP reads it, ``int(key)``); None for anything else."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63:
        return value
    return None


SKIP_REASONS = (
    "undecodable_image",  # PIL cannot decode it (corrupt, truncated, an unknown format)
    "empty_caption",  # no text on the caption's first line: nothing to contrast the image with
    "non_utf8_caption",  # .txt bytes that are not UTF-8 (OpenCLIP skips these too)
    "no_usable_index",  # only for a loss with per-sample state: .json or its index missing or out of range
    "duplicate_key",  # a key seen before in the same shard: the first sample under it is kept
    "incomplete",  # no image or no .txt member, e.g. the last sample of a shard cut short
    "unreadable_shard",  # a shard that cannot be opened or read at all: counted once per attempt
)
"""Why the training loader skips a sample; the counts are logged per reason (``train/data/skipped/*``)."""


class _BadSample(ValueError):
    """A sample the training loader skips and counts under ``reason`` (one of SKIP_REASONS)."""

    def __init__(self, reason: str, url: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.url = reason, url


class _FailureLog:
    """Counts skipped samples by reason and stops a stream that only fails.

    The counts live in shared memory created before the DataLoader starts its workers, so the skips of
    every worker add up. A long run of failures with no good sample in between (e.g. every image in a
    format PIL cannot decode) raises, naming the shards, instead of skipping forever.
    """

    def __init__(self, max_in_a_row: int) -> None:
        self._counts = multiprocessing.Array("q", len(SKIP_REASONS))
        self._in_a_row = 0  # per process
        self._shards_in_a_row: dict[str, None] = {}  # the shards of the current run of failures, in order
        self._warned = 0
        self.max_in_a_row = max_in_a_row

    @property
    def total(self) -> int:
        return sum(self.by_reason().values())

    def by_reason(self) -> dict[str, int]:
        return dict(zip(SKIP_REASONS, self._counts[:]))  # one read under the array's lock

    def skip(self, bad: _BadSample) -> None:
        """Count one skipped sample (or unreadable shard) and log the first few of this process."""
        with self._counts.get_lock():
            self._counts[SKIP_REASONS.index(bad.reason)] += 1
        self.warn(f"skipping a sample ({bad.reason}): {bad}")
        self._count_failure(bad.url, str(bad))

    def warn(self, message: str) -> None:
        if self._warned < _WARNINGS_PER_PROCESS:
            self._warned += 1
            logger.warning("%s", message[:500])

    def note_empty_shard(self, url: str) -> None:
        self._count_failure(url, f"{url} holds no samples")

    def note_success(self) -> None:
        self._in_a_row = 0
        self._shards_in_a_row.clear()

    def _count_failure(self, url: str, what: str) -> None:
        self._in_a_row += 1
        self._shards_in_a_row[url] = None
        if self._in_a_row >= self.max_in_a_row:
            shards = list(self._shards_in_a_row)
            named = ", ".join(shards[:5]) + (f" and {len(shards) - 5} more" if len(shards) > 5 else "")
            raise RuntimeError(
                f"{self._in_a_row} samples in a row could not be read or used, none good in between, "
                f"from {len(shards)} shard(s): {named} (last: {what[:300]}). The data is missing or corrupt, "
                "in a format PIL cannot decode, or without usable indices (data.index_key, "
                "data.index_size)"
            )


class TrainLoader:
    """Training batches ``(images [b,3,H,W] float, tokens [b,ctx] long, indices [b] int64)`` from shards.

    Every rank yields exactly ``num_batches`` full batches per epoch. ``indices`` are the samples' stable
    dataset indices, read from ``.json[index_key]`` (an integer or a string of digits). Call
    :meth:`set_epoch` before iterating each epoch.

    ``num_samples`` (samples per epoch) and ``index_size`` (rows of the per-sample table) are taken as
    given or read from the records beside the shards (see :mod:`.sizes`). With ``needs_index`` a sample
    whose index is missing or not below ``index_size`` is skipped and counted like a corrupt one; without
    it (a loss that keeps no per-sample state) indices are passed on unchecked, -1 where there is none.
    Every skipped sample is counted under one of :data:`SKIP_REASONS` (:attr:`skipped_by_reason`).
    """

    def __init__(
        self,
        sources: Sequence[str],
        *,
        preprocess: Preprocess,
        tokenize: Tokenize,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        resampled: bool = False,
        weights: Sequence[float] | None = None,
        num_samples: int | None = None,
        index_size: int | None = None,
        needs_index: bool = True,
        shuffle_buffer: int = 1000,
        workers: int = 2,
        index_key: str = "key",
    ) -> None:
        if isinstance(sources, str):
            sources = [sources]
        if (
            batch_size < 1
            or world_size < 1
            or not 0 <= rank < world_size
            or workers < 0
            or shuffle_buffer < 0
        ):
            raise ValueError(
                f"invalid loader settings: batch_size={batch_size}, rank={rank}, world_size={world_size}, "
                f"workers={workers}, shuffle_buffer={shuffle_buffer}"
            )
        self.preprocess = preprocess
        self.tokenize = tokenize
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.resampled = resampled
        self.shuffle_buffer = shuffle_buffer
        self.workers = workers
        self.index_key = index_key
        self.needs_index = needs_index
        self.set_epoch(0)

        per_source = [expand_urls(source) for source in sources]
        self.urls = [url for urls in per_source for url in urls]
        if not self.urls:
            raise ValueError(f"no shards in {list(sources)}")
        if weights is not None and not resampled:
            raise ValueError("per-source weights need resampled=True (data.resampled)")
        self._cum_weights = self._shard_cum_weights(per_source, weights) if resampled else None

        self.sizes = resolve_sizes(
            self.urls,
            num_samples=num_samples,
            index_size=index_size,
            needs_index=needs_index,
            index_key=index_key,
        )
        self.num_samples = num_samples = self.sizes.num_samples
        # Rows of the per-sample table (data.index_size); None when no loss keeps per-sample state.
        self.dataset_size = self.sizes.index_size
        if rank == 0:
            logger.info(
                "%d samples per epoch (from %s); per-sample table: %s",
                num_samples,
                self.sizes.num_samples_from,
                "not needed"
                if self.dataset_size is None
                else f"{self.dataset_size} rows (from {self.sizes.index_size_from})",
            )
        self.num_batches = num_samples // (batch_size * world_size)
        self._epoch_samples = self.num_batches * batch_size * world_size  # the remainder is left out
        if self.num_batches < 1:
            raise ValueError(
                f"{num_samples} samples per epoch do not fill one batch of {batch_size} on each of "
                f"{world_size} ranks; lower the batch size or raise data.num_samples"
            )
        # each shard's count, where the records give them all and they hold the epoch: the epoch is then
        # split between the consumers (rank x worker) at sample granularity
        counts = self.sizes.shard_counts
        self._shard_counts = counts if counts and sum(counts) >= self._epoch_samples else None
        consumers = world_size * max(workers, 1)
        if not resampled and self._shard_counts is None:
            # whole shards per consumer: some read one shard more than others, wrap or are cut
            spare = len(self.urls) % consumers
            uneven = min(spare, consumers - spare) * math.ceil(num_samples / len(self.urls))
            if counts is not None:
                why = f"the shards hold {sum(counts)} samples, fewer than an epoch's {self._epoch_samples}"
                uneven = self._epoch_samples - sum(counts)
            else:
                why = "no record (manifest.json, sizes.json, *_stats.json) counts the samples of every shard"
                uneven = num_samples if len(self.urls) < consumers else uneven
            if uneven:
                warnings.warn(
                    f"{why}: {world_size} ranks x {max(workers, 1)} loader workers read whole shards of the "
                    f"{len(self.urls)}, so up to about {uneven} samples an epoch repeat and as many may not "
                    "be drawn. Write the counts (eva-fastclip make-shards, OpenCLIP's sizes.json) and an "
                    "epoch no larger than the data to draw every sample once",
                    stacklevel=2,
                )
        self._failures = _FailureLog(max_in_a_row=_MAX_FAILURES_IN_A_ROW + shuffle_buffer)

    @staticmethod
    def _shard_cum_weights(per_source: list[list[str]], weights: Sequence[float] | None) -> list[float]:
        """Cumulative per-shard weights: a source's weight is its share of draws, split over its shards."""
        if weights is None:
            return list(itertools.accumulate(1.0 for urls in per_source for _ in urls))
        if len(weights) != len(per_source) or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(
                f"weights {list(weights)} must be one non-negative number per source, not all zero"
            )
        return list(itertools.accumulate(w / len(urls) for w, urls in zip(weights, per_source) for _ in urls))

    @property
    def skipped(self) -> int:
        """Samples skipped so far (unreadable, or without a usable index), summed over workers and epochs."""
        return self._failures.total

    @property
    def skipped_by_reason(self) -> dict[str, int]:
        """:attr:`skipped` by reason: every one of :data:`SKIP_REASONS`, zero where none was skipped."""
        return self._failures.by_reason()

    def set_epoch(self, epoch: int) -> None:
        """The next iteration yields ``epoch`` from its start."""
        self.epoch = epoch
        self._start = 0  # micro-batches of the epoch yielded before this iteration (a resumed epoch)
        self._offset = 0  # an approximately resumed epoch: shards skipped (epoch-wise) or the stream's salt
        self._resume: dict[int, tuple] = {}  # worker -> the _Stream state to continue from
        self._streams: dict[int, tuple] = {}  # worker -> its _Stream state after its latest batch yielded
        self._batches = 0  # micro-batches of the epoch yielded so far

    def state_dict(self) -> dict[str, Any]:
        """This rank's position in the epoch after the micro-batches yielded so far, for :meth:`resume`."""
        return {
            "epoch": self.epoch,
            "batches": self._batches,
            "offset": self._offset,
            "streams": dict(self._streams),
            "layout": self._layout(),
        }

    def resume(self, epoch: int, batches: int, state: dict[str, Any] | None = None) -> bool:
        """The next iteration yields ``epoch`` after its first ``batches`` micro-batches; returns whether
        exactly as an uninterrupted run goes on.

        Exactly with ``state`` from :meth:`state_dict` of this rank's loader in the same layout (ranks,
        workers, batch, seed, shards, shuffle buffer): each worker's stream is rebuilt where it stood. The
        shuffle is replayed on sample numbers, which costs no reading (its draws depend on counts alone),
        and only the samples still in the buffer and the shard being read are read again. Otherwise
        approximately: an epoch-wise epoch with every shard counted skips each worker's share of the
        ``batches`` done at sample granularity (:meth:`_epoch_segments`), one without counts the share of
        its shard order that ``batches`` stands for; a resampled one draws a stream of its own.
        """
        self.set_epoch(epoch)
        self._start = self._batches = batches
        if state is not None and (state["epoch"], state["batches"], state["layout"]) == (
            epoch,
            batches,
            self._layout(),
        ):
            self._offset = state["offset"]
            self._resume = {int(worker): tuple(stream) for worker, stream in state["streams"].items()}
            self._streams = dict(self._resume)
            return True
        if self.resampled or self._shard_counts is not None:
            self._offset = batches  # each worker skips its share of the batches done (_epoch_segment)
        else:
            self._offset = min(len(self.urls) - 1, batches * len(self.urls) // self.num_batches)
        return False

    def _layout(self) -> dict[str, Any]:
        """What decides this rank's streams besides the epoch: an exact resume needs the same."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "workers": self.workers,
            "batch_size": self.batch_size,
            "num_batches": self.num_batches,
            "seed": self.seed,
            "resampled": self.resampled,
            "shuffle_buffer": self.shuffle_buffer,
            "shards": zlib.crc32("\n".join(os.path.basename(url) for url in self.urls).encode()),
            # a checkpoint of whole-shard streams (or other counts) must not be continued as segments
            "plan": "whole shards"
            if self._shard_counts is None
            else zlib.crc32(str(self._shard_counts).encode()),
        }

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        if self._start >= self.num_batches:  # resumed at the epoch's end: no worker to start
            return
        batches_per_worker = math.ceil(self.num_batches / max(self.workers, 1))
        pipeline = wds.DataPipeline(
            functools.partial(self._raw_samples, self.epoch),
            wds.map(self._to_example, handler=self._skip_bad_sample),
            wds.batched(self.batch_size, collation_fn=self._collate, partial=False),
        ).with_epoch(batches_per_worker)
        loader = DataLoader(
            pipeline,
            batch_size=None,
            num_workers=self.workers,
            persistent_workers=False,
            # a generator of its own for the workers' base seed (which nothing uses): starting a loader
            # must not draw from the global one, which masks patches in the training step
            generator=torch.Generator().manual_seed(self.seed),
        )
        # The workers together make >= num_batches; the cut makes every rank yield exactly num_batches.
        self._batches, self._streams = self._start, dict(self._resume)
        for images, tokens, indices, (worker, stream) in itertools.islice(
            loader, self.num_batches - self._start
        ):
            self._streams[worker] = tuple(stream)
            self._batches += 1
            yield images, tokens, indices

    def _raw_samples(self, epoch: int) -> Iterator[dict[str, Any]]:
        """This rank's and worker's endless stream of undecoded samples for ``epoch``."""
        worker, num_workers = _worker_info()
        # batches come round-robin from the workers: a resumed epoch's first batch is the next of the
        # worker whose turn it was, so the workers are numbered on from there
        worker = (worker + self._start) % num_workers
        resume = self._resume.get(worker)
        if self.resampled:
            salt = f":{self._offset}" if self._offset else ""
            rng = random.Random(f"resampled:{self.seed}:{epoch}:{self.rank}:{worker}{salt}")
            shards = (rng.choices(self.urls, cum_weights=self._cum_weights)[0] for _ in itertools.count())
            yield from self._pass(worker, 0, shards, rng, resume)
            return
        consumer = self.rank * num_workers + worker
        consumers = self.world_size * num_workers
        for pass_number in itertools.count(resume[0] if resume else 0):
            order = list(self.urls)
            random.Random(f"shards:{self.seed}:{epoch}:{pass_number}").shuffle(order)  # same on every rank
            if pass_number <= 1 and self._shard_counts is not None:
                mine = self._epoch_segments(epoch, worker, num_workers)[pass_number]
            else:
                # whole shards; a later pass only where a consumer ran short (samples skipped, a shard
                # holding fewer than its record says): it must still fill its batches
                if pass_number == 0:
                    order = order[self._offset :]  # an approximately resumed epoch: the shards read already
                # With too few shards, consumers share them rather than run dry.
                mine = (
                    order[consumer::consumers] if len(order) >= consumers else [order[consumer % len(order)]]
                )
            rng = random.Random(f"samples:{self.seed}:{epoch}:{pass_number}:{self.rank}:{worker}")
            yield from self._pass(worker, pass_number, iter(mine), rng, resume)
            resume = None

    def _epoch_segments(
        self, epoch: int, worker: int, num_workers: int
    ) -> tuple[list[Segment], list[Segment]]:
        """What this rank's ``worker`` reads in passes 0 and 1 of ``epoch``, as (shard, first, stop) sample
        numbers of shards (stop None: to the shard's end).

        Every rank orders the shards alike from (seed, epoch), so their samples line up in one sequence of
        which the first num_batches x batch x ranks make the epoch; the rest, under one global batch, is
        the remainder. Rank r's block of the epoch is its num_batches x batch samples, and within it each
        worker's range holds as many samples as its round-robin share of the rank's batches needs. So the
        ranges tile the epoch: every sample once, a shard split between consumers where a range ends inside
        it: that is pass 0. A worker whose range runs short (samples skipped as unusable) goes on to pass 1:
        its own share of the remainder, the rest of the remainder, then the rest of the sequence; each
        skipped sample is replaced by one sample, drawn twice at worst (a pass of its own, so the shuffle
        buffer drains the range first). An
        approximately resumed epoch (another layout) starts each range after its share of the batches done.
        """
        counts = self._shard_counts
        order = list(range(len(self.urls)))
        random.Random(f"shards:{self.seed}:{epoch}:0").shuffle(order)  # the permutation of pass 0's order
        quotas = [len(range(w, self.num_batches, num_workers)) * self.batch_size for w in range(num_workers)]
        start = self.rank * self.num_batches * self.batch_size + sum(quotas[:worker])
        stop = start + quotas[worker]
        start += len(range(worker, self._offset, num_workers)) * self.batch_size
        epoch_end, total = self._epoch_samples, sum(counts)
        consumer, consumers = self.rank * num_workers + worker, self.world_size * num_workers
        spare = epoch_end + (total - epoch_end) * consumer // consumers  # where its share of the remainder is
        ranges = [(start, stop), (spare, total), (epoch_end, spare), (stop, epoch_end), (0, start)]
        segments: list[list[Segment]] = [[], []]
        for number, (low, high) in enumerate(ranges):
            position = 0
            for shard in order:
                first, last = max(low, position), min(high, position + counts[shard])
                if first < last:
                    to_end = last == position + counts[shard]  # then what follows its last sample is ours
                    segment = (self.urls[shard], first - position, None if to_end else last - position)
                    segments[min(number, 1)].append(segment)
                position += counts[shard]
                if position >= high:
                    break
        return segments[0], segments[1]

    def _pass(
        self, worker: int, pass_number: int, shard_urls: Iterator[str], rng: random.Random, resume
    ) -> Iterator[dict[str, Any]]:
        """One pass of a worker's stream through the shuffle buffer, from its start or from ``resume``
        (a _Stream state of this pass). Each sample carries where the stream stood when it was handed out
        (``__pos__``: the state's parts, the finished shards' counts as a prefix of the growing list)."""
        stream = _Stream(pass_number) if resume is None else _Stream(*resume)
        buffer: list[Any] = []
        if resume is None:
            reader = self._counted(shard_urls, stream)
        else:
            reader = self._fast_forward(shard_urls, rng, stream, buffer)
        for sample in _shuffle(reader, rng, self.shuffle_buffer, buffer):
            stream.taken += 1
            sample["__pos__"] = (worker, stream, stream.taken, len(stream.counts), stream.read)
            yield sample

    def _counted(self, shard_urls: Iterator[str], stream: _Stream) -> Iterator[dict[str, Any]]:
        """The shards' samples, counted per shard into ``stream``."""
        for url in shard_urls:
            for sample in self._read([url]):
                stream.read += 1
                yield sample
            stream.counts.append(stream.read)
            stream.read = 0

    def _fast_forward(
        self, shard_urls: Iterator[str], rng: random.Random, stream: _Stream, buffer: list[Any]
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

        replay = _shuffle(numbers(), rng, self.shuffle_buffer, buffer)
        if sum(1 for _ in itertools.islice(replay, stream.taken)) < stream.taken:
            raise ValueError(_position_mismatch(stream, "its shards hold fewer samples"))
        wanted: dict[int, dict[int, list[int]]] = {}  # shard -> sample -> places in the buffer
        for place, (shard, j) in enumerate(buffer):
            wanted.setdefault(shard, {}).setdefault(j, []).append(place)
        for shard, samples in sorted(wanted.items()):
            if shard != current:  # read up to the last sample wanted
                last, j = max(samples), -1
                for j, sample in enumerate(itertools.islice(self._read([urls[shard]]), last + 1)):
                    for place in samples.get(j, ()):
                        buffer[place] = sample
                if j < last:
                    raise ValueError(_position_mismatch(stream, f"shard {urls[shard]} holds fewer samples"))
        if current is None:
            return self._counted(shard_urls, stream)
        reader = iter(self._read([urls[current]]))  # read to where it stood, and on from there
        j = -1
        for j, sample in enumerate(itertools.islice(reader, stream.read)):
            for place in wanted.get(current, {}).get(j, ()):
                buffer[place] = sample
        if j + 1 < stream.read:
            raise ValueError(_position_mismatch(stream, f"shard {urls[current]} holds fewer samples"))
        return itertools.chain(self._rest_of_shard(reader, stream), self._counted(shard_urls, stream))

    def _rest_of_shard(self, reader: Iterator[dict[str, Any]], stream: _Stream) -> Iterator[dict[str, Any]]:
        for sample in reader:
            stream.read += 1
            yield sample
        stream.counts.append(stream.read)
        stream.read = 0

    def _read(self, shard_urls: Iterable[str | Segment]) -> Iterator[dict[str, Any]]:
        """The samples of whole shards, or of segments (shard, first, stop) of them."""
        for item in shard_urls:
            url, first, stop = (item, 0, None) if isinstance(item, str) else item
            yield from self._shard_samples(url, first, stop)

    def _shard_samples(self, url: str, first: int = 0, stop: int | None = None) -> Iterator[dict[str, Any]]:
        """One shard's undecoded samples numbered ``first`` up to ``stop`` (None: its end): its members
        grouped by key as webdataset groups them, except that a key names one sample. A later group under a
        key seen before in the shard (right after it or further on) is skipped and counted and the first
        kept, where webdataset drops the repeat member by member, or merges the two. A read error ends the
        shard and every sample before it is kept: a sample cut after some of its members is passed on and
        judged like any other; one cut at its first member is counted as incomplete at once, before the
        sample ahead of it is passed on.

        Samples are numbered as kept, so every reader of the shard numbers them alike; those before
        ``first`` are read past (their bytes, never decoded), and a problem is counted only by the reader
        whose numbers it falls among, so a shard split between consumers counts each skip once."""
        seen: set[str] = set()
        group: dict[str, Any] | None = None
        failed = False
        kept = 0  # samples kept so far: the number of the next one

        def ours() -> bool:
            return first <= kept and (stop is None or kept < stop)

        for key, extension, data in _tar_members(url):
            new = key is not None and (group is None or group["__key__"] != key or extension in group)
            if isinstance(data, Exception):
                failed = True
                if ours():
                    self._failures.warn(f"{url}: unreadable from here on, the rest is lost: {data!r}")
                    if new:
                        message = f"shard {url}, sample {key!r}: cut short at its first member ({data!r})"
                        self._failures.skip(_BadSample("incomplete", url, message))
                    elif group is None:  # not one member could be read
                        self._failures.skip(_BadSample("unreadable_shard", url, f"{url}: {data!r}"))
                break  # the last item: the shard's stream is broken
            if new:
                if group is not None and self._first_of_key(group, seen, count=ours()):
                    if kept >= first:
                        yield group
                    kept += 1
                    if stop is not None and kept >= stop:
                        return
                group = {"__key__": key, "__url__": url}
            group[extension] = data
        if group is not None:
            if self._first_of_key(group, seen, count=ours()) and kept >= first:
                yield group
        elif not failed and first == 0:
            self._failures.note_empty_shard(url)

    def _first_of_key(self, group: dict[str, Any], seen: set[str], count: bool = True) -> bool:
        """Whether ``group`` is the first under its key in its shard; a repeat is counted as a skip (where
        ``count``)."""
        key = group["__key__"]
        if key in seen:
            if count:
                message = f"shard {group['__url__']}: key {key!r} again; the first sample under it is kept"
                self._failures.skip(_BadSample("duplicate_key", group["__url__"], message))
            return False
        seen.add(key)
        return True

    def _to_example(self, sample: dict[str, Any]) -> tuple[Tensor, str, int]:
        """(image, caption, index) of a sample, or _BadSample saying why it cannot train.

        Only the members training uses are decoded, the image last: it costs the most."""
        url = sample["__url__"]
        where = f"shard {url}, sample {sample['__key__']!r}"
        image_key = next((key for key in IMAGE_KEYS if key in sample), None)
        if image_key is None or "txt" not in sample:
            missing = "image (.jpg/.jpeg/.png/.webp)" if image_key is None else "caption (.txt)"
            raise _BadSample("incomplete", url, f"{where}: no {missing}")
        try:
            caption = _first_line(sample["txt"].decode("utf-8"))
        except UnicodeDecodeError as exn:
            raise _BadSample("non_utf8_caption", url, f"{where}: its .txt is not UTF-8 ({exn})") from None
        if not caption:
            raise _BadSample("empty_caption", url, f"{where}: its caption is empty")
        index = self._index(sample, url, where)
        try:
            image = _decode_image(sample[image_key])
        except Exception as exn:  # PIL raises many kinds: OSError, SyntaxError, DecompressionBombError...
            message = f"{where}: .{image_key} does not decode ({exn!r})"
            raise _BadSample("undecodable_image", url, message) from None
        self._failures.note_success()
        return self._preprocess(image, sample["__pos__"]), caption, index, sample["__pos__"]

    def _index(self, sample: dict[str, Any], url: str, where: str) -> int:
        """The sample's index from ``.json[index_key]``; -1 where it has none and the loss needs none."""
        meta = None
        if "json" in sample:
            with contextlib.suppress(ValueError):  # not JSON, or not UTF-8: as good as no .json
                meta = json.loads(sample["json"])
        index = parse_index(meta.get(self.index_key)) if isinstance(meta, dict) else None
        if not self.needs_index:
            return -1 if index is None else index
        if index is not None and index < self.dataset_size:
            return index
        # a wrong index would silently corrupt another sample's per-sample state
        if "json" not in sample:
            problem = f"no .json, so no {self.index_key!r} (data.index_key)"
        elif not isinstance(meta, dict):
            problem = "its .json is not a JSON object"
        elif self.index_key not in meta:
            problem = f"its .json has no {self.index_key!r} (data.index_key)"
        else:
            problem = (
                f"{self.index_key}={meta[self.index_key]!r} is not an index in "
                f"[0, {self.dataset_size}) (data.index_size: {self.sizes.index_size_from})"
            )
        raise _BadSample("no_usable_index", url, f"{where}: {problem}")

    def _skip_bad_sample(self, exn: Exception) -> bool:
        if isinstance(exn, _BadSample):
            self._failures.skip(exn)
            return True
        raise exn

    def _preprocess(self, image: PIL.Image.Image, position: tuple) -> Tensor:
        """The training transform (a random crop) with torch's generator seeded by the sample's place in the
        stream, so that a resumed epoch crops every sample as the uninterrupted one would have; the
        process's own generator is left as it was (with no workers it is the training step's)."""
        worker, stream, taken = position[:3]
        place = f"{self.seed}:{self.epoch}:{self._offset}:{self.rank}:{worker}:{stream.pass_number}:{taken}"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(zlib.crc32(place.encode()))
            return self.preprocess(image)

    def _collate(self, examples: list[tuple]) -> tuple[Tensor, Tensor, Tensor, tuple]:
        """The batch, and its worker and that worker's _Stream state right after the batch's last sample
        was handed out (webdataset batches a sample later: the stream may be further on by now)."""
        images, captions, indices, positions = zip(*examples)
        worker, stream, taken, finished, read = positions[-1]
        state = (stream.pass_number, taken, tuple(stream.counts[:finished]), read)
        return (
            torch.stack(images),
            self.tokenize(list(captions)),
            torch.tensor(indices, dtype=torch.int64),
            (worker, state),
        )


class _Stream:
    """Where a worker's stream of an epoch stands: the pass, the samples the shuffle buffer has handed out
    in it, the samples of each shard it finished reading in it (in reading order) and how many it has
    read of the shard it is reading. With the seeds that is all it takes to rebuild the stream there."""

    def __init__(self, pass_number: int, taken: int = 0, counts: Iterable[int] = (), read: int = 0) -> None:
        self.pass_number, self.taken, self.counts, self.read = pass_number, taken, list(counts), read

    def state(self) -> tuple[int, int, tuple[int, ...], int]:
        return self.pass_number, self.taken, tuple(self.counts), self.read


def _shuffle(samples: Iterable[Any], rng: random.Random, size: int, buffer: list[Any]) -> Iterator[Any]:
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


def _position_mismatch(stream: _Stream, what: str) -> str:
    return (
        f"cannot continue the epoch where it stopped (pass {stream.pass_number}, {stream.taken} samples "
        f"taken): {what} than when the checkpoint was saved. Resume with the shards the run was started on"
    )


def _tar_members(url: str) -> Iterator[tuple[str | None, str, bytes | Exception]]:
    """(key, extension, bytes) of every file in the tar shard at ``url``, named as webdataset names them
    (the key is the path up to the file name's first dot; the extension is lower-cased). A read error ends
    it with (key, extension, error) if a member's data failed, else (None, "", error)."""
    key, extension = None, ""
    try:
        with contextlib.closing(wds.gopen(url)) as stream, tarfile.open(fileobj=stream, mode="r|*") as tar:
            for member in tar:
                tar.members = []  # a stream keeps every header it read: drop them, as webdataset does
                if not member.isreg() or _META_MEMBER.match(member.name):
                    continue
                key, extension = base_plus_ext(member.name)
                if key is None:
                    continue
                extension = extension.lower()
                data = tar.extractfile(member).read()
                yield key, extension, data
                key, extension = None, ""
    except Exception as exn:  # missing, not a tar, cut short, a failing pipe: command
        yield key, extension, exn


def _decode_image(data: bytes) -> PIL.Image.Image:
    """The image fully decoded, as RGB (as webdataset's "pil" decoder gives it)."""
    with io.BytesIO(data) as stream:
        image = PIL.Image.open(stream)
        image.load()
        return image.convert("RGB")


def _warn_and_skip(exn: Exception) -> bool:
    logger.warning("evaluation: skipping unreadable sample: %s", repr(exn)[:500])
    return True


def _ordered_pipeline(urls: list[str], *stages: Any) -> wds.DataPipeline:
    """Shards in the given order, split between loader workers, decoded to PIL; every sample once."""
    return wds.DataPipeline(
        wds.SimpleShardList(urls),
        wds.split_by_worker,
        wds.tarfile_to_samples(handler=_warn_and_skip),
        wds.decode("pil", handler=_warn_and_skip),
        *stages,
    )


def _collate_image_text(tokenize: Tokenize, examples: list[tuple[Tensor, str]]) -> tuple[Tensor, Tensor]:
    images, captions = zip(*examples)
    return torch.stack(images), tokenize(list(captions))


def _collate_image_label(examples: list[tuple[Tensor, int]]) -> tuple[Tensor, Tensor]:
    images, labels = zip(*examples)
    return torch.stack(images), torch.tensor(labels, dtype=torch.int64)


def build_retrieval_loader(
    sources: str | Sequence[str],
    *,
    preprocess: Preprocess,
    tokenize: Tokenize,
    batch_size: int,
    workers: int = 0,
) -> Iterable[tuple[Tensor, Tensor]]:
    """``(images, tokens)`` batches of image-text pairs, each sample once, unshuffled (in shard order when
    ``workers`` is 0); the caption is the first line of the sample's .txt."""
    pipeline = _ordered_pipeline(
        expand_urls(sources),
        wds.to_tuple(_IMAGE_FIELD, "txt"),
        wds.map_tuple(preprocess, _first_line),
        wds.batched(batch_size, collation_fn=functools.partial(_collate_image_text, tokenize), partial=True),
    )
    return DataLoader(pipeline, batch_size=None, num_workers=workers)


def _check_label(num_classes: int, label: int) -> int:
    if not 0 <= label < num_classes:
        raise ValueError(
            f"class label {label} outside [0, {num_classes}): classnames.txt does not match the shards"
        )
    return label


def _read_lines(path: Path) -> list[str]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (clip_benchmark layout expected)")
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line]


def read_classification_folder(dataset_dir: str | os.PathLike) -> tuple[list[str], list[str], list[str]]:
    """The shards, class names and prompt templates of a clip_benchmark-layout classification folder.

    Reads the names of ``dataset_dir/test/*.tar``, ``classnames.txt`` (one class per line) and
    ``zeroshot_classification_templates.txt`` (one template per line). A template marks the class name
    with "{c}", as clip_benchmark's files do, or "{}" (clip_benchmark's builder rewrites such prompts to
    "{c}"; ``evaluation.fill_template`` fills either). FileNotFoundError or ValueError naming the file.
    """
    root = Path(dataset_dir)
    if not root.is_dir():
        raise FileNotFoundError(
            f"{root}: no such folder (clip_benchmark layout expected: test/*.tar, classnames.txt, "
            "zeroshot_classification_templates.txt)"
        )
    shards = sorted(glob.glob(os.path.join(glob.escape(str(root / "test")), "*.tar")))
    if not shards:
        raise FileNotFoundError(f"{root / 'test'}: no *.tar shards (clip_benchmark layout expected)")
    classnames = _read_lines(root / "classnames.txt")
    if not classnames:
        raise ValueError(f"{root / 'classnames.txt'} names no class")
    templates = _read_lines(root / "zeroshot_classification_templates.txt")
    bad = [template for template in templates if not any(p in template for p in TEMPLATE_PLACEHOLDERS)]
    if bad or not templates:
        raise ValueError(
            f"{root / 'zeroshot_classification_templates.txt'}: every line needs a {{c}} or {{}} placeholder "
            "for the class name" + (f" ({bad[0]!r} has none)" if bad else " (the file has no line)")
        )
    return shards, classnames, templates


def build_classification_loader(
    dataset_dir: str | os.PathLike,
    *,
    preprocess: Preprocess,
    batch_size: int,
    workers: int = 0,
) -> tuple[Iterable[tuple[Tensor, Tensor]], list[str], list[str]]:
    """A clip_benchmark-layout classification set: ``(loader of (images, labels), classnames, templates)``.

    Reads ``dataset_dir/test/*.tar`` ({key}.jpg/png/webp + {key}.cls), ``classnames.txt`` and
    ``zeroshot_classification_templates.txt`` (:func:`read_classification_folder`).
    """
    shards, classnames, templates = read_classification_folder(dataset_dir)
    pipeline = _ordered_pipeline(
        shards,
        wds.to_tuple(_IMAGE_FIELD, "cls"),
        wds.map_tuple(preprocess, functools.partial(_check_label, len(classnames))),
        wds.batched(batch_size, collation_fn=_collate_image_label, partial=True),
    )
    return DataLoader(pipeline, batch_size=None, num_workers=workers), classnames, templates
