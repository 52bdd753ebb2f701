"""The training stream: exactly ``num_batches`` batches per rank and epoch, every sample once.

The stream is endless inside each loader worker and cut to exactly ``num_batches`` per rank and epoch: a
rank that stopped early would leave the others waiting in a collective forever.

- Epoch-wise: each rank x worker consumer reads what :class:`.EpochPlan` gives it: with every shard's
  count known its own range of the epoch's sample sequence (every sample once, the remainder under one
  global batch left out), else whole shards; a consumer that runs short tops up from a later pass.
- Resampled: shards are drawn with replacement, weighted per source, seeded by (seed, epoch, rank, worker).

The shuffle buffer restarts with every pass, so samples of the next pass never overtake this one's.

A rank's batches come round-robin from its workers. Every batch carries where its worker's stream stands
(``_Stream``) and the samples it skipped so far, and ``TrainLoader.state_dict`` keeps the latest of each
worker: a resumed run continues the epoch exactly where it stopped (``TrainLoader.resume``), reading again
only the samples that were still in the shuffle buffers and the shards being read, never decoding what it
skips, and its skip counts go on from the saved ones.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import math
import os
import random
import time
import warnings
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import webdataset as wds
from torch import Tensor
from torch.utils.data import DataLoader

from eva_fastclip.reliability.signals import ignore_stop_signals

from .epoch_plan import EpochPlan, EpochRest, Segment, Tiling
from .image_transform import TrainImageTransform, decode_on_device, normalize
from .sample_keys import sample_key
from .sizes import DataSizes, resolve_sizes
from .tar_reader import (
    IMAGE_KEYS,
    SKIP_REASONS,
    BadSample,
    FailureLog,
    Preprocess,
    Tokenize,
    decode_image,
    first_line,
    parse_index,
    shard_samples,
)
from .urls import expand_urls
from .workers import start_worker_server, worker_context

logger = logging.getLogger(__name__)

_MAX_FAILURES_IN_A_ROW = 1000


def _worker_info() -> tuple[int, int]:
    """(worker id, number of workers) of the current DataLoader worker; (0, 1) in the main process."""
    info = torch.utils.data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class TrainLoader:
    """Training batches ``(images, tokens [b,ctx] long, indices [b] int64, keys [b] int64)`` from shards;
    :meth:`to_device` makes the images what the model takes, on its device. ``keys`` are the samples' keys
    (:meth:`_sample_key`): each seeds its sample's crop here and its token mask in the model.

    With open_clip's training transform (:class:`.TrainImageTransform` recognises it) the workers decode,
    crop and resize, and hand uint8 images ``[b,3,H,W]`` to the trainer, which normalises them on its
    device: a quarter of float32's bytes through shared memory and pinned memory. With ``decode_device``
    they only read each JPEG's header and draw its crop, and the batch is a list that :meth:`to_device`
    decodes there (nvjpeg on a GPU). Any other ``preprocess`` runs in the workers as given, float out.

    Every rank yields exactly ``num_batches`` full batches per epoch, a multiple of ``accumulation`` (the
    micro-batches of an optimizer step: an epoch is whole steps). ``indices`` are the samples' stable
    dataset indices, read from ``.json[index_key]`` (an integer or a string of digits). Call
    :meth:`set_epoch` before iterating each epoch.

    ``num_samples`` (samples per epoch) and ``index_size`` (rows of the per-sample table) are taken as
    given or read from the records beside the shards (see :mod:`.sizes`), unless ``sizes`` holds them
    read already (a run reads them on rank 0 and hands them to every rank). With ``needs_index`` a sample
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
        sizes: DataSizes | None = None,
        decode_device: torch.device | str | None = None,
        pin_memory: bool = False,
        accumulation: int = 1,
    ) -> None:
        if isinstance(sources, str):
            sources = [sources]
        if (
            batch_size < 1
            or world_size < 1
            or not 0 <= rank < world_size
            or workers < 0
            or shuffle_buffer < 0
            or accumulation < 1
        ):
            raise ValueError(
                f"invalid loader settings: batch_size={batch_size}, rank={rank}, world_size={world_size}, "
                f"workers={workers}, shuffle_buffer={shuffle_buffer}, accumulation={accumulation}"
            )
        self.preprocess = preprocess
        self.image_transform = TrainImageTransform.from_preprocess(preprocess)
        if decode_device is not None and self.image_transform is None:
            raise ValueError(
                "data.image_decode=gpu needs open_clip's training transform (RandomResizedCrop, RGB, "
                f"ToTensor, Normalize); this model's is {preprocess!r}: set data.image_decode=workers"
            )
        self.decode_device = None if decode_device is None else torch.device(decode_device)
        self.pin_memory = pin_memory
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

        if sizes is None:
            sizes = resolve_sizes(
                self.urls,
                num_samples=num_samples,
                index_size=index_size,
                needs_index=needs_index,
                index_key=index_key,
            )
        elif sizes.shard_counts is not None and len(sizes.shard_counts) != len(self.urls):
            raise ValueError(
                f"the sizes given count {len(sizes.shard_counts)} shards, the sources {list(sources)} hold "
                f"{len(self.urls)}: read them from the same data.train_shards"
            )
        elif needs_index and sizes.index_size is None:
            raise ValueError("the sizes given have no index_size, which a loss with per-sample state needs")
        self.sizes = sizes
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
        # whole optimizer steps: a step never spans two epochs (nor takes a sample twice at their seam)
        step = batch_size * world_size * accumulation
        self.num_batches = num_samples // step * accumulation
        if self.num_batches < 1:
            per_step = f" x {accumulation} a step" if accumulation > 1 else ""
            raise ValueError(
                f"{num_samples} samples per epoch do not fill one batch of {batch_size}{per_step} on each of "
                f"{world_size} ranks; lower the batch size or raise data.num_samples"
            )
        self._tiling = Tiling(world_size, workers, batch_size, self.num_batches)
        self._plan = EpochPlan(self.urls, self.sizes.shard_counts, seed=seed, tiling=self._tiling)
        uneven = None if resampled else self._plan.unevenness(num_samples)
        if uneven:
            warnings.warn(uneven, stacklevel=2)
        self._failures = FailureLog(max_in_a_row=_MAX_FAILURES_IN_A_ROW + shuffle_buffer)
        self._skipped_before = [0] * len(SKIP_REASONS)  # skips of the iterations before this one
        self._skips: dict[int, tuple[int, ...]] = {}  # worker -> its skips up to its latest batch yielded
        self.worker_pids: list[int] = []  # the current epoch's loader workers
        if workers:
            start_worker_server()

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
        """Samples skipped so far (unreadable, or without a usable index), summed over workers and epochs:
        those the streams passed over up to the batches yielded (not what workers read ahead), so a
        resumed run counts as the uninterrupted one does."""
        return sum(self.skipped_by_reason.values())

    @property
    def skipped_by_reason(self) -> dict[str, int]:
        """:attr:`skipped` by reason: every one of :data:`SKIP_REASONS`, zero where none was skipped."""
        counts = [sum(column) for column in zip(self._skipped_before, *self._skips.values())]
        return dict(zip(SKIP_REASONS, counts))

    def set_epoch(self, epoch: int) -> None:
        """The next iteration yields ``epoch`` from its start."""
        self.epoch = epoch
        self._start = 0  # micro-batches of the epoch yielded before this iteration (a resumed epoch)
        self._offset = 0  # an approximately resumed epoch: batches or shards skipped, the streams' salt
        self._rest = EpochRest()  # what the epoch's batches tile (resumed on another layout: what was left)
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
            "rest": self._rest.state(),
            "skipped": self.skipped_by_reason,
        }

    def load_skipped(self, by_reason: dict[str, int]) -> None:
        """Count on from a resumed run's skips (its ``state_dict()["skipped"]``). An exact resume reads
        again what its streams had read before the save without counting it twice; an approximate one
        (another layout) counts a bad sample again where its streams pass over it again."""
        self._skipped_before = [int(by_reason.get(reason, 0)) for reason in SKIP_REASONS]
        self._skips = {}

    def resume(self, epoch: int, batches: int, state: dict[str, Any] | None = None) -> bool:
        """The next iteration yields ``epoch`` after its first ``batches`` micro-batches; returns whether
        exactly as an uninterrupted run goes on.

        Exactly with ``state`` from :meth:`state_dict` of this rank's loader in the same layout (ranks,
        workers, batch, seed, shards, shuffle buffer): each worker's stream is rebuilt where it stood. The
        shuffle is replayed on sample numbers, which costs no reading (its draws depend on counts alone),
        and only the samples still in the buffer and the shard being read are read again.

        Otherwise approximately. An epoch-wise epoch with every shard counted re-tiles what is left: the
        consumers of ``state``'s layout (of any rank: every rank must be given the same) are taken to have
        drawn the start of their ranges, and this layout's ranges tile the rest
        (:meth:`.EpochPlan.rest_after`); without ``state``, as if it had been this layout's. One without
        counts skips the share of its shard order that ``batches`` stands for; a resampled one draws a
        stream of its own.
        """
        self.set_epoch(epoch)
        self._start = self._batches = batches
        if state is not None and (state["epoch"], state["batches"], state["layout"]) == (
            epoch,
            batches,
            self._layout(),
        ):
            self._offset = state["offset"]
            self._rest = EpochRest.from_state(state.get("rest"))
            self._resume = {int(worker): tuple(stream) for worker, stream in state["streams"].items()}
            self._streams = dict(self._resume)
            return True
        if self.resampled:
            self._offset = batches  # a salt: a stream of its own
        elif self._plan.by_samples:
            self._offset = batches
            done, done_rest, batches_done = self._tiling, EpochRest(), batches
            if state is not None and state["epoch"] == epoch and self._same_plan(state["layout"]):
                saved = state["layout"]
                done = Tiling(*(saved[key] for key in ("world_size", "workers", "batch_size", "num_batches")))
                done_rest, batches_done = EpochRest.from_state(state.get("rest")), state["batches"]
            self._rest = self._plan.rest_after(done, done_rest, batches_done, first_batch=batches)
        else:
            self._offset = self._plan.whole_shards_done(batches)
        return False

    def _same_plan(self, layout: dict[str, Any]) -> bool:
        """Whether a position saved with ``layout`` is in this epoch's sample sequence."""
        mine = self._layout()
        return all(layout.get(key) == mine[key] for key in ("seed", "resampled", "shards", "plan"))

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
            "plan": self._plan.fingerprint(),
        }

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor]]:
        self._skipped_before = list(self.skipped_by_reason.values())  # the streams start counting anew
        self._skips = {}
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
            # not forked from the rank, whose previous loader's threads may be exiting (data/workers.py)
            multiprocessing_context=worker_context() if self.workers else None,
            pin_memory=self.pin_memory,  # page-locked batches: the copy to the GPU runs asynchronously
            # a generator of its own for the workers' base seed (which nothing uses): starting a loader
            # must not draw from the global one, which masks patches in the training step
            generator=torch.Generator().manual_seed(self.seed),
            worker_init_fn=ignore_stop_signals,  # the rank finishes its step and saves: data/workers.py
        )
        # The workers together make >= num_batches; the cut makes every rank yield exactly num_batches.
        self._batches, self._streams = self._start, dict(self._resume)
        topped_up = 0  # batches that drew on the top-up pass: a worker's range ran short
        batches = iter(loader)
        workers = getattr(batches, "_workers", ())
        self.worker_pids = [worker.pid for worker in workers]  # (a hang names them)
        for images, tokens, indices, keys, (worker, stream, skips) in _naming_dead_workers(
            itertools.islice(batches, self.num_batches - self._start), workers, self.rank
        ):
            self._streams[worker] = tuple(stream)
            self._skips[worker] = tuple(skips)
            self._batches += 1
            topped_up += stream[0] > 0 and self._plan.by_samples and not self.resampled
            yield images, tokens, indices, keys
        if topped_up:
            logger.warning(
                "epoch %d, rank %d: %d of %d batches drew on samples outside their worker's share of the "
                "epoch (some drawn twice this epoch): its range held fewer usable samples than its batches "
                "take. Samples skipped so far: %d; otherwise a shard holds fewer samples than its record",
                self.epoch, self.rank, topped_up, self._batches - self._start, self.skipped,
            )  # fmt: skip

    def _raw_samples(self, epoch: int) -> Iterator[dict[str, Any]]:
        """This rank's and worker's endless stream of undecoded samples for ``epoch``."""
        worker, num_workers = _worker_info()
        self._failures.start()
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
        for pass_number in itertools.count(resume[0] if resume else 0):
            mine = self._plan.reads(epoch, pass_number, self.rank, worker, self._rest, self._offset)
            rng = random.Random(f"samples:{self.seed}:{epoch}:{pass_number}:{self.rank}:{worker}")
            yield from self._pass(worker, pass_number, iter(mine), rng, resume)
            resume = None

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
        self._failures.muted = True  # read before the save: its problems are in the saved counts
        for shard, samples in sorted(wanted.items()):
            if shard != current:  # read up to the last sample wanted
                last, j = max(samples), -1
                for j, sample in enumerate(itertools.islice(self._read([urls[shard]]), last + 1)):
                    for place in samples.get(j, ()):
                        buffer[place] = sample
                if j < last:
                    raise ValueError(_position_mismatch(stream, f"shard {urls[shard]} holds fewer samples"))
        if current is None:
            self._failures.muted = False
            return self._counted(shard_urls, stream)
        reader = iter(self._read([urls[current]]))  # read to where it stood, and on from there
        j = -1
        for j, sample in enumerate(itertools.islice(reader, stream.read)):
            for place in wanted.get(current, {}).get(j, ()):
                buffer[place] = sample
        self._failures.muted = False
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
            yield from shard_samples(url, self._failures, first, stop)

    def _to_example(self, sample: dict[str, Any]) -> tuple[Tensor, str, int]:
        """(image, caption, index) of a sample, or BadSample saying why it cannot train.

        Only the members training uses are decoded, the image last: it costs the most."""
        url = sample["__url__"]
        where = f"shard {url}, sample {sample['__key__']!r}"
        image_key = next((key for key in IMAGE_KEYS if key in sample), None)
        if image_key is None or "txt" not in sample:
            missing = "image (.jpg/.jpeg/.png/.webp)" if image_key is None else "caption (.txt)"
            raise BadSample("incomplete", url, f"{where}: no {missing}")
        try:
            caption = first_line(sample["txt"].decode("utf-8"))
        except UnicodeDecodeError as exn:
            raise BadSample("non_utf8_caption", url, f"{where}: its .txt is not UTF-8 ({exn})") from None
        if not caption:
            raise BadSample("empty_caption", url, f"{where}: its caption is empty")
        index = self._index(sample, url, where)
        # where the stream stood, with its skips up to this sample: those a resumed stream counts from
        position = (*sample["__pos__"], tuple(self._failures.counts))
        key = self._sample_key(sample, index, position)
        try:
            image = self._image(sample[image_key], key)
        except Exception as exn:  # decoders raise many kinds: OSError, RuntimeError, DecompressionBombError
            message = f"{where}: .{image_key} does not decode ({exn!r})"
            raise BadSample("undecodable_image", url, message) from None
        self._failures.note_success()
        return image, caption, index, key, position

    def _sample_key(self, sample: dict[str, Any], index: int, position: tuple) -> int:
        """The key (data/sample_keys.py) that seeds the sample's crop here and its token mask in the
        model: the sample is its dataset index, else its shard's URL and key; its occurrence is the pass of
        the epoch's plan (a top-up draws it again). A resampled stream draws samples with replacement and
        depends on the layout anyway: there the draw's place in its stream is the occurrence."""
        worker, stream, taken = position[:3]
        sample_id = index if index >= 0 else f"{sample['__url__']}/{sample['__key__']}"
        occurrence = f"{self.rank}:{worker}:{self._offset}:{taken}" if self.resampled else stream.pass_number
        return sample_key(self.seed, self.epoch, sample_id, occurrence)

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
        raise BadSample("no_usable_index", url, f"{where}: {problem}")

    def _skip_bad_sample(self, exn: Exception) -> bool:
        if isinstance(exn, BadSample):
            self._failures.skip(exn)
            return True
        raise exn

    def _image(self, data: bytes, seed: int) -> Tensor | Any:
        """The training transform (a random crop) of a sample's encoded image, its draws seeded by the
        sample's key; the process's own generators are left as they were (with no workers they are the
        training step's)."""
        if self.image_transform is None:  # any transform: it draws from torch's CPU generator
            image = decode_image(data)
            with torch.random.fork_rng(devices=[]):
                # not torch.manual_seed: in a worker it also records a stack trace for the lazy CUDA
                # seeding, about 1 ms per sample (docs/benchmarks.md, data loading)
                torch.default_generator.manual_seed(seed)
                return self.preprocess(image)
        generator = torch.Generator().manual_seed(seed)
        if self.decode_device is not None:
            return self.image_transform.device_plan(data, generator)
        return self.image_transform(data, generator)

    def to_device(self, images: Tensor | list, device: torch.device, dtype: torch.dtype) -> Tensor:
        """A batch's images as the model takes them, on ``device``: decoded there (``decode_device``),
        normalised there (uint8 from the workers), or moved (float from a transform of the user's)."""
        return self.model_input(self.onto_device(images, device), dtype)

    def onto_device(self, images: Tensor | list, device: torch.device) -> Tensor:
        """A batch's images on ``device``, not yet normalised: uint8 with open_clip's transform (decoded
        there with ``decode_device``), else as the transform made them. What a cached step holds."""
        if isinstance(images, list):
            return decode_on_device(images, self.image_transform, device)
        return images.to(device, non_blocking=True)

    def model_input(self, images: Tensor, dtype: torch.dtype) -> Tensor:
        """Images from :meth:`onto_device` as the model takes them: normalised (uint8), or cast."""
        if images.dtype != torch.uint8:
            return images.to(dtype=dtype)
        return normalize(images, self.image_transform.mean, self.image_transform.std, dtype)

    def _collate(self, examples: list[tuple]) -> tuple[Tensor, Tensor, Tensor, tuple]:
        """The batch, and its worker, that worker's _Stream state right after the batch's last sample was
        handed out and its skips up to there (webdataset batches a sample later: the stream may be further
        on by now)."""
        images, captions, indices, keys, positions = zip(*examples)
        worker, stream, taken, finished, read, skips = positions[-1]
        state = (stream.pass_number, taken, tuple(stream.counts[:finished]), read)
        return (
            list(images) if self.decode_device is not None else torch.stack(images),
            self.tokenize(list(captions)),
            torch.tensor(indices, dtype=torch.int64),
            torch.tensor(keys, dtype=torch.int64),
            (worker, state, skips),
        )


class _Stream:
    """Where a worker's stream of an epoch stands: the pass, the samples the shuffle buffer has handed out
    in it, the samples of each shard it finished reading in it (in reading order) and how many it has
    read of the shard it is reading. With the seeds that is all it takes to rebuild the stream there."""

    def __init__(self, pass_number: int, taken: int = 0, counts: Iterable[int] = (), read: int = 0) -> None:
        self.pass_number, self.taken, self.counts, self.read = pass_number, taken, list(counts), read

    def state(self) -> tuple[int, int, tuple[int, ...], int]:
        return self.pass_number, self.taken, tuple(self.counts), self.read


def _naming_dead_workers(batches: Iterator[Any], workers: Sequence[Any], rank: int) -> Iterator[Any]:
    """``batches``; a failure while a worker has died (the OOM killer: PyTorch names it, or its queue's
    pipe breaks first, naming nobody) is raised again naming the dead workers."""
    try:
        yield from batches
    except (RuntimeError, OSError, EOFError) as err:
        # a broken pipe comes a moment before the fork server reports the worker's end (PyTorch's own
        # RuntimeError names it already)
        patience = 0.0 if isinstance(err, RuntimeError) else 5.0
        deadline = time.monotonic() + patience
        while not (dead := [worker for worker in workers if not worker.is_alive()]):
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)
        codes = ", ".join(f"pid {worker.pid} (exit code {worker.exitcode})" for worker in dead)
        raise RuntimeError(
            f"rank {rank}'s training loader worker(s) died: {codes}; a negative code is the signal that "
            "ended it (-9: SIGKILL, e.g. the kernel's OOM killer: give them more memory, or use fewer)"
        ) from err


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
