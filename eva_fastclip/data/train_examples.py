"""A raw training sample made an example: its caption, its dataset index, its key and its cropped image.

What cannot train (no image or caption, a caption that is not UTF-8 or empty, no usable index, an image
that does not decode) raises :class:`.BadSample`, which the stream counts and skips.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from torch import Tensor

from .captions import Captions
from .epoch_position import EpochPosition
from .sample_keys import sample_key
from .sizes import DataSizes
from .tar_reader import IMAGE_KEYS, BadSample, FailureLog, parse_index
from .train_images import TrainImages

_NO_CAPTION = {
    "incomplete": "no caption",
    "non_utf8_caption": "its caption is not UTF-8",
    "empty_caption": "its caption is empty",
}


class ExampleMaker:
    """Makes (image, caption, index, key, position) of a rank's samples; ``position`` gives the epoch and
    the salt of an approximately resumed resampled stream, ``failures`` the stream's skips so far."""

    def __init__(
        self,
        images: TrainImages,
        failures: FailureLog,
        position: EpochPosition,
        *,
        sizes: DataSizes,
        index_key: str,
        needs_index: bool,
        seed: int,
        rank: int,
        resampled: bool,
        captions: Captions | None = None,
    ) -> None:
        self.images, self.failures, self.position, self.sizes = images, failures, position, sizes
        self.captions = captions or Captions()
        self.index_key, self.needs_index = index_key, needs_index
        self.seed, self.rank, self.resampled = seed, rank, resampled

    def example(self, sample: dict[str, Any]) -> tuple[Tensor, str, int, int, tuple]:
        """(image, caption, index, key, position) of a sample, or BadSample saying why it cannot train.

        Only the members training uses are decoded, the image last: it costs the most."""
        url = sample["__url__"]
        where = f"shard {url}, sample {sample['__key__']!r}"
        image_key = next((key for key in IMAGE_KEYS if key in sample), None)
        if image_key is None:
            raise BadSample("incomplete", url, f"{where}: no image (.jpg/.jpeg/.png/.webp)")
        index = self._index(sample, url, where)
        # where the stream stood, with its skips up to this sample: those a resumed stream counts from
        position = (*sample["__pos__"], tuple(self.failures.counts))
        key = self._sample_key(sample, index, position)
        caption, problem = self.captions.choose(sample, key)  # (data/captions.py)
        if caption is None:
            raise BadSample(problem, url, f"{where}: {_NO_CAPTION[problem]} ({self.captions.describe()})")
        try:
            image = self.images.crop(sample[image_key], key)
        except Exception as exn:  # decoders raise many kinds: OSError, RuntimeError, DecompressionBombError
            message = f"{where}: .{image_key} does not decode ({exn!r})"
            raise BadSample("undecodable_image", url, message) from None
        self.failures.note_success()
        return image, caption, index, key, position

    def skip_bad_sample(self, exn: Exception) -> bool:
        """The pipeline's handler: count and skip a BadSample, raise anything else."""
        if isinstance(exn, BadSample):
            self.failures.skip(exn)
            return True
        raise exn

    def _sample_key(self, sample: dict[str, Any], index: int, position: tuple) -> int:
        """The key (data/sample_keys.py) that seeds the sample's crop here and its token mask in the
        model: the sample is its dataset index, else its shard's URL and key; its occurrence is the pass of
        the epoch's plan (a top-up draws it again). A resampled stream draws samples with replacement and
        depends on the layout anyway: there the draw's place in its stream is the occurrence."""
        worker, stream, taken = position[:3]
        sample_id = index if index >= 0 else f"{sample['__url__']}/{sample['__key__']}"
        offset = self.position.offset
        occurrence = f"{self.rank}:{worker}:{offset}:{taken}" if self.resampled else stream.pass_number
        return sample_key(self.seed, self.position.epoch, sample_id, occurrence)

    def _index(self, sample: dict[str, Any], url: str, where: str) -> int:
        """The sample's index from ``.json[index_key]``; -1 where it has none and the loss needs none."""
        meta = None
        if "json" in sample:
            with contextlib.suppress(ValueError):  # not JSON, or not UTF-8: as good as no .json
                meta = json.loads(sample["json"])
        index = parse_index(meta.get(self.index_key)) if isinstance(meta, dict) else None
        if not self.needs_index:
            return -1 if index is None else index
        if index is not None and index < self.sizes.index_size:
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
                f"[0, {self.sizes.index_size}) (data.index_size: {self.sizes.index_size_from})"
            )
        raise BadSample("no_usable_index", url, f"{where}: {problem}")
