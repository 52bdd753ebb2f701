"""The training stream: exactly ``num_batches`` batches per rank and epoch, every sample once.

The stream is endless inside each loader worker and cut to exactly ``num_batches`` per rank and epoch: a
rank that stopped early would leave the others waiting in a collective forever.

- Epoch-wise: each rank x worker consumer reads what :class:`.EpochPlan` gives it: with every shard's
  count known its own range of the epoch's sample sequence (every sample once, the remainder under one
  global batch left out), else whole shards; a consumer that runs short tops up from a later pass.
- Resampled: shards are drawn with replacement, weighted per source, seeded by (seed, epoch, rank, worker).

A rank's batches come round-robin from its workers. Every batch carries where its worker's stream stands
(:class:`.Stream`) and the samples it skipped so far, and ``TrainLoader.state_dict`` keeps the latest of
each worker: a resumed run continues the epoch exactly where it stopped (``TrainLoader.resume``), reading
again only the samples that were still in the shuffle buffers and the shards being read, never decoding
what it skips, and its skip counts go on from the saved ones.

The parts, each in its module: the workers' streams (worker_streams.py), the epoch's position and its
resume (epoch_position.py), a sample made an example (train_examples.py), its image in the worker and on
the device (train_images.py), the skip counts (skip_counts.py), the DataLoader over the workers
(train_workers.py). This module sizes the epoch and puts them together.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import warnings
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import webdataset as wds
from torch import Tensor

from eva_fastclip.config import ExperimentConfig

from .captions import Captions
from .epoch_plan import EpochPlan, Tiling
from .epoch_position import EpochPosition
from .remote import Retries
from .sizes import DataSizes, resolve_sizes
from .skip_counts import SkipCounts
from .tar_reader import FailureLog, Preprocess, Tokenize
from .train_examples import ExampleMaker
from .train_images import TrainImages
from .train_workers import naming_dead_workers, train_dataloader
from .worker_streams import WorkerStreams, shard_urls
from .workers import start_worker_server

logger = logging.getLogger(__name__)

_MAX_FAILURES_IN_A_ROW = 1000


class TrainLoader:
    """Training batches ``(images, tokens [b,ctx] long, indices [b] int64, keys [b] int64)`` from shards;
    :meth:`to_device` makes the images what the model takes, on its device. ``keys`` are the samples' keys
    (:class:`.ExampleMaker`): each seeds its sample's crop here and its token mask in the model.

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

    @classmethod
    def for_run(
        cls,
        cfg: ExperimentConfig,
        *,
        micro_batch: int,
        accumulation: int,
        preprocess: Preprocess,
        tokenize: Tokenize,
        needs_index: bool,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | None = None,
        sizes: DataSizes | None = None,
        workers: int | None = None,
    ) -> TrainLoader:
        """The loader a run of ``cfg`` trains from, as the Trainer builds it (``eva-fastclip loader-speed``
        too): its shards and data.* settings, the layout's micro-batch and accumulation, the data's sizes
        where read already (by rank 0: plan/run_plan.py), ``workers`` in place of data.workers."""
        data = cfg.data
        return cls(
            data.train_shards,
            preprocess=preprocess,
            tokenize=tokenize,
            batch_size=micro_batch,
            rank=rank,
            world_size=world_size,
            seed=cfg.train.seed,
            resampled=data.resampled,
            weights=data.train_weights,
            num_samples=data.num_samples,
            index_size=data.index_size,
            needs_index=needs_index,  # only per-sample state needs indices: OpenCLIP's loss trains without
            shuffle_buffer=data.shuffle_buffer,
            workers=data.workers if workers is None else workers,
            index_key=data.index_key,
            sizes=sizes,
            decode_device=device if data.image_decode == "gpu" else None,
            pin_memory=device is not None and device.type == "cuda",
            accumulation=accumulation,
            retries=Retries(data.read_retries, data.retry_wait_s),
            captions=Captions(tuple(data.caption_keys), _weights(data.caption_weights)),
        )

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
        retries: Retries | None = None,
        captions: Captions | None = None,
    ) -> None:
        if isinstance(sources, str):
            sources = [sources]
        _check_settings(batch_size, rank, world_size, workers, shuffle_buffer, accumulation)
        self._images = TrainImages(preprocess, decode_device)
        self.preprocess = preprocess
        self.image_transform = self._images.transform
        self.decode_device = self._images.decode_device
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
        self.retries = retries or Retries()  # a remote shard's failed requests (data/remote.py)
        self.captions = captions or Captions()  # which of a sample's captions it trains with
        self._position = EpochPosition()
        self._layout_record: dict[str, Any] | None = None
        self.urls, cum_weights = shard_urls(sources, weights, resampled)
        self.sizes = _epoch_sizes(self.urls, sources, sizes, num_samples, index_size, needs_index, index_key)
        self.num_samples = num_samples = self.sizes.num_samples
        # Rows of the per-sample table (data.index_size); None when no loss keeps per-sample state.
        self.dataset_size = self.sizes.index_size
        if rank == 0:
            _log_sizes(self.sizes)
        self.num_batches = _batches_per_epoch(num_samples, batch_size, world_size, accumulation)
        self._tiling = Tiling(world_size, workers, batch_size, self.num_batches)
        self._plan = EpochPlan(self.urls, self.sizes.shard_counts, seed=seed, tiling=self._tiling)
        uneven = None if resampled else self._plan.unevenness(num_samples)
        if uneven:
            warnings.warn(uneven, stacklevel=2)
        self._streams, self._examples = self._make_streams(cum_weights)
        self._skips = SkipCounts()
        self.worker_pids: list[int] = []  # the current epoch's loader workers
        if workers:
            start_worker_server()

    def _make_streams(self, cum_weights: list[float] | None) -> tuple[WorkerStreams, ExampleMaker]:
        """The workers' streams and the examples made of their samples. One FailureLog counts what either
        skips; a run of failures stops the stream only above a shuffle buffer's worth."""
        failures = FailureLog(max_in_a_row=_MAX_FAILURES_IN_A_ROW + self.shuffle_buffer)
        streams = WorkerStreams(
            self.urls,
            self._plan,
            failures,
            cum_weights=cum_weights,
            seed=self.seed,
            rank=self.rank,
            resampled=self.resampled,
            shuffle_buffer=self.shuffle_buffer,
            retries=self.retries,
        )
        examples = ExampleMaker(
            self._images,
            failures,
            self._position,
            sizes=self.sizes,
            index_key=self.index_key,
            needs_index=self.needs_index,
            seed=self.seed,
            rank=self.rank,
            resampled=self.resampled,
            captions=self.captions,
        )
        return streams, examples

    @property
    def epoch(self) -> int:
        """The epoch the next iteration yields (:meth:`set_epoch`, :meth:`resume`)."""
        return self._position.epoch

    @property
    def skipped(self) -> int:
        """Samples skipped so far (unreadable, or without a usable index), summed over workers and epochs:
        those the streams passed over up to the batches yielded (not what workers read ahead), so a
        resumed run counts as the uninterrupted one does."""
        return sum(self.skipped_by_reason.values())

    @property
    def skipped_by_reason(self) -> dict[str, int]:
        """:attr:`skipped` by reason: every one of :data:`SKIP_REASONS`, zero where none was skipped."""
        return self._skips.by_reason()

    def set_epoch(self, epoch: int) -> None:
        """The next iteration yields ``epoch`` from its start."""
        self._position.reset(epoch)

    def state_dict(self) -> dict[str, Any]:
        """This rank's position in the epoch after the micro-batches yielded so far, for :meth:`resume`."""
        return self._position.state_dict(self._layout(), self.skipped_by_reason)

    def load_skipped(self, by_reason: dict[str, int]) -> None:
        """Count on from a resumed run's skips (its ``state_dict()["skipped"]``). An exact resume reads
        again what its streams had read before the save without counting it twice; an approximate one
        (another layout) counts a bad sample again where its streams pass over it again."""
        self._skips.load(by_reason)

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
        return self._position.resume_at(
            batches,
            state,
            layout=self._layout(),
            plan=self._plan,
            tiling=self._tiling,
            resampled=self.resampled,
        )

    def _layout(self) -> dict[str, Any]:
        """What decides this rank's streams besides the epoch: an exact resume needs the same. Computed
        once (the shards' names hashed: ~85 ms for 200k), since every micro-batch's position holds it."""
        if self._layout_record is None:
            self._layout_record = self._make_layout()
        return self._layout_record

    def _make_layout(self) -> dict[str, Any]:
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
        self._skips.restart()  # the streams start counting anew
        before = self.skipped_by_reason
        position = self._position
        if position.start >= self.num_batches:  # resumed at the epoch's end: no worker to start
            return
        batches_per_worker = math.ceil(self.num_batches / max(self.workers, 1))
        pipeline = wds.DataPipeline(
            functools.partial(self._streams.samples, self.epoch, position),
            wds.map(self._examples.example, handler=self._examples.skip_bad_sample),
            wds.batched(self.batch_size, collation_fn=self._collate, partial=False),
        ).with_epoch(batches_per_worker)
        loader = train_dataloader(pipeline, workers=self.workers, seed=self.seed, pin_memory=self.pin_memory)
        # The workers together make >= num_batches; the cut makes every rank yield exactly num_batches.
        position.begin()
        topped_up = 0  # batches that drew on the top-up pass: a worker's range ran short
        batches = iter(loader)
        workers = getattr(batches, "_workers", ())
        self.worker_pids = [worker.pid for worker in workers]  # (a hang names them)
        for images, tokens, indices, keys, (worker, stream, skips) in naming_dead_workers(
            itertools.islice(batches, self.num_batches - position.start), workers, self.rank, batches
        ):
            position.advance(worker, stream)
            self._skips.note(worker, skips)
            topped_up += stream[0] > 0 and self._plan.by_samples and not self.resampled
            yield images, tokens, indices, keys
        if topped_up:
            logger.warning("%s", self._coverage_gap(topped_up, position.batches - position.start, before))

    def _coverage_gap(self, topped_up: int, batches: int, before: dict[str, int]) -> str:
        """The report of an epoch that did not draw every sample once on this rank: what it skipped."""
        now = self.skipped_by_reason
        skipped = {reason: now[reason] - before[reason] for reason in now if now[reason] > before[reason]}
        why = ", ".join(f"{reason} {n}" for reason, n in skipped.items())
        return (
            f"epoch {self.epoch}, rank {self.rank}: not every sample of its share was drawn once: "
            f"{sum(skipped.values())} skipped this epoch ({why or 'none'}), and {topped_up} of {batches} "
            "batches drew on samples outside their worker's share in their place (from the remainder, or "
            "drawn twice)" + ("" if skipped else ": a shard holds fewer samples than its record")
        )

    def to_device(self, images: Tensor | list, device: torch.device, dtype: torch.dtype) -> Tensor:
        """A batch's images as the model takes them, on ``device``: decoded there (``decode_device``),
        normalised there (uint8 from the workers), or moved (float from a transform of the user's)."""
        return self.model_input(self.onto_device(images, device), dtype)

    def onto_device(self, images: Tensor | list, device: torch.device) -> Tensor:
        """A batch's images on ``device``, not yet normalised: uint8 with open_clip's transform (decoded
        there with ``decode_device``), else as the transform made them. What a cached step holds."""
        return self._images.onto_device(images, device)

    def model_input(self, images: Tensor, dtype: torch.dtype) -> Tensor:
        """Images from :meth:`onto_device` as the model takes them: normalised (uint8), or cast."""
        return self._images.model_input(images, dtype)

    def _collate(self, examples: list[tuple]) -> tuple[Tensor, Tensor, Tensor, tuple]:
        """The batch, and its worker, that worker's Stream state right after the batch's last sample was
        handed out and its skips up to there (webdataset batches a sample later: the stream may be further
        on by now)."""
        images, captions, indices, keys, positions = zip(*examples)
        worker, stream, taken, finished, read, skips = positions[-1]
        state = (stream.pass_number, taken, tuple(stream.counts[:finished]), read)
        return (
            self._images.batch(images),
            self.tokenize(list(captions)),
            torch.tensor(indices, dtype=torch.int64),
            torch.tensor(keys, dtype=torch.int64),
            (worker, state, skips),
        )


def _check_settings(
    batch_size: int, rank: int, world_size: int, workers: int, shuffle_buffer: int, accumulation: int
) -> None:
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


def _epoch_sizes(
    urls: list[str],
    sources: Sequence[str],
    sizes: DataSizes | None,
    num_samples: int | None,
    index_size: int | None,
    needs_index: bool,
    index_key: str,
) -> DataSizes:
    """The data's sizes: ``sizes`` as given (read on rank 0 and handed to every rank), checked against the
    shards, else as given or read from the records beside the shards."""
    if sizes is None:
        return resolve_sizes(
            urls, num_samples=num_samples, index_size=index_size, needs_index=needs_index, index_key=index_key
        )
    if sizes.shard_counts is not None and len(sizes.shard_counts) != len(urls):
        raise ValueError(
            f"the sizes given count {len(sizes.shard_counts)} shards, the sources {list(sources)} hold "
            f"{len(urls)}: read them from the same data.train_shards"
        )
    if needs_index and sizes.index_size is None:
        raise ValueError("the sizes given have no index_size, which a loss with per-sample state needs")
    return sizes


def _log_sizes(sizes: DataSizes) -> None:
    table = (
        "not needed"
        if sizes.index_size is None
        else f"{sizes.index_size} rows (from {sizes.index_size_from})"
    )
    logger.info(
        "%d samples per epoch (from %s); per-sample table: %s",
        sizes.num_samples,
        sizes.num_samples_from,
        table,
    )


def _batches_per_epoch(num_samples: int, batch_size: int, world_size: int, accumulation: int) -> int:
    """Micro-batches per rank and epoch: whole optimizer steps, so that a step never spans two epochs (nor
    takes a sample twice at their seam)."""
    step = batch_size * world_size * accumulation
    num_batches = num_samples // step * accumulation
    if num_batches < 1:
        per_step = f" x {accumulation} a step" if accumulation > 1 else ""
        raise ValueError(
            f"{num_samples} samples per epoch do not fill one batch of {batch_size}{per_step} on each of "
            f"{world_size} ranks; lower the batch size or raise data.num_samples"
        )
    return num_batches


def _weights(weights: Sequence[float] | None) -> tuple[float, ...] | None:
    return None if weights is None else tuple(float(w) for w in weights)
