"""Evaluation sets as numbered samples, and each rank's share of them in whole batches.

Sample i of a set is its i-th in reading order: shards in order and members in order within a shard (an
index of the tar headers gives each member's offset), or image files in torchvision ImageFolder's order.
Batch b holds samples [b·B, (b+1)·B) and rank r of W takes the batches b ≡ r (mod W): a batch holds the
same images whatever W, so each image is encoded in the same company as on one rank and K-rank results
equal 1-rank results exactly. A rank reads only its own samples' bytes; loader workers split its batches.
"""

from __future__ import annotations

import io
import logging
import os
import tarfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import PIL.Image
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from eva_fastclip.data.workers import worker_context, worker_init

log = logging.getLogger(__name__)

#: image members as clip_benchmark's webdataset builder reads them, in its order of preference
IMAGE_EXTENSIONS = ("webp", "png", "jpg", "jpeg")
_WARNINGS_PER_PROCESS = 10


@dataclass(frozen=True, slots=True)
class StoredSample:
    """Where one sample's bytes are: members of a tar shard ``{extension: (offset, size)}``, or (with
    ``members`` None) one image file whose label or captions the set already knows."""

    path: str
    members: dict[str, tuple[int, int]] | None = None
    label: int | None = None
    captions: tuple[str, ...] | None = None

    def read(self) -> dict[str, bytes]:
        """The sample's files by extension; an image file's bytes under "image"."""
        with open(self.path, "rb") as f:
            if self.members is None:
                return {"image": f.read()}
            parts = {}
            for extension, (offset, size) in self.members.items():
                f.seek(offset)
                parts[extension] = f.read(size)
            return parts

    def image_bytes(self, parts: dict[str, bytes]) -> bytes:
        for extension in ("image", *IMAGE_EXTENSIONS):
            if extension in parts:
                return parts[extension]
        raise ValueError(f"{self.path}: sample has no image member ({', '.join(IMAGE_EXTENSIONS)})")


def index_tar_shards(shards: Sequence[str], keep: Callable[[str], bool]) -> list[StoredSample]:
    """The samples of ``shards`` in order, grouped by webdataset's key rule (the member name up to the
    first dot of its base name), keeping the members whose lower-case extension ``keep`` accepts. Reads
    only the tar headers."""
    samples: list[StoredSample] = []
    for shard in shards:
        current_key, members = None, {}
        with tarfile.open(shard, "r:") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                directory, name = os.path.split(info.name)
                if (name.startswith("__") and name.endswith("__")) or "." not in name:
                    continue  # webdataset's metadata members and extension-less files belong to no sample
                stem, extension = name.split(".", 1)
                key = os.path.join(directory, stem)
                if key != current_key:
                    if members:
                        samples.append(StoredSample(shard, members))
                    current_key, members = key, {}
                if keep(extension.lower()):
                    members[extension.lower()] = (info.offset_data, info.size)
        if members:
            samples.append(StoredSample(shard, members))
    return samples


def decode_image(data: bytes) -> PIL.Image.Image:
    with PIL.Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


class SampleDataset(Dataset):
    """Sample i as ``(i, preprocessed image, target(parts, sample))``, or None when it cannot be read
    (a warning names it; the evaluation counts it as skipped)."""

    def __init__(
        self,
        samples: Sequence[StoredSample],
        preprocess: Callable[[PIL.Image.Image], Tensor],
        target: Callable[[dict[str, bytes], StoredSample], Any],
    ) -> None:
        self.samples, self.preprocess, self.target = samples, preprocess, target
        self._warnings = 0

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, ordinal: int) -> tuple[int, Tensor, Any] | None:
        sample = self.samples[ordinal]
        try:
            parts = sample.read()
            image = self.preprocess(decode_image(sample.image_bytes(parts)))
            return ordinal, image, self.target(parts, sample)
        except Exception as err:  # noqa: BLE001 (one bad sample is skipped, as the training stream does)
            self._warnings += 1
            if self._warnings <= _WARNINGS_PER_PROCESS:
                log.warning("evaluation: skipping sample %d of %s: %r", ordinal, sample.path, err)
            return None


def own_batches(num_samples: int, batch_size: int, rank: int, world_size: int) -> list[list[int]]:
    """The sample numbers of rank ``rank``'s batches: batches b ≡ rank (mod world_size)."""
    starts = range(rank * batch_size, num_samples, world_size * batch_size)
    return [list(range(start, min(start + batch_size, num_samples))) for start in starts]


def _collate(items: list[tuple[int, Tensor, Any] | None]) -> tuple[Tensor, Tensor | None, list[Any]]:
    items = [item for item in items if item is not None]
    if not items:
        return torch.zeros(0, dtype=torch.int64), None, []
    ordinals, images, targets = zip(*items)
    return torch.tensor(ordinals, dtype=torch.int64), torch.stack(images), list(targets)


def share_loader(
    dataset: SampleDataset, *, batch_size: int, rank: int, world_size: int, workers: int
) -> Iterator[tuple[Tensor, Tensor | None, list[Any]]]:
    """This rank's batches as ``(sample numbers, images, targets)``; a batch whose every sample failed
    has images None."""
    batches = own_batches(len(dataset), batch_size, rank, world_size)
    return worker_loader(dataset, len(batches), workers, batch_sampler=batches, collate_fn=_collate)


def worker_loader(dataset: Dataset, count: int, workers: int, **loading: Any) -> Iterator[Any]:
    """``DataLoader(dataset, **loading)``, which yields ``count`` items, read by up to ``workers`` workers
    (no more than it has items); nothing to read: an empty iterator."""
    if not count:
        return iter(())
    workers = min(workers, count)
    loader = DataLoader(
        dataset,
        num_workers=workers,
        # not forked from the rank, whose loader threads may be exiting (data/workers.py)
        multiprocessing_context=worker_context() if workers else None,
        worker_init_fn=worker_init(),  # the rank's environment; a stop is honoured after the evaluation
        **loading,
    )
    return iter(loader)
