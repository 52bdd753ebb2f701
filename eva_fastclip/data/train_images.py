"""A training sample's image from its bytes in the loader worker, and a batch's images on the rank's device.

With open_clip's training transform (:class:`.TrainImageTransform` recognises it) the workers decode,
crop and resize, and hand uint8 images ``[b,3,H,W]`` to the trainer, which normalises them on its device.
With a ``decode_device`` the workers only read each JPEG's header and draw its crop, and the batch is a
list decoded there (nvjpeg on a GPU). Any other ``preprocess`` runs in the workers as given, float out.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .image_transform import TrainImageTransform, decode_on_device, normalize
from .tar_reader import Preprocess, decode_image


class TrainImages:
    """The image half of the training loader: the crop in the worker, the rest on the device."""

    def __init__(self, preprocess: Preprocess, decode_device: torch.device | str | None) -> None:
        self.preprocess = preprocess
        self.transform = TrainImageTransform.from_preprocess(preprocess)
        if decode_device is not None and self.transform is None:
            raise ValueError(
                "data.image_decode=gpu needs open_clip's training transform (RandomResizedCrop, RGB, "
                f"ToTensor, Normalize); this model's is {preprocess!r}: set data.image_decode=workers"
            )
        self.decode_device = None if decode_device is None else torch.device(decode_device)

    def crop(self, data: bytes, seed: int) -> Tensor | Any:
        """The training transform (a random crop) of a sample's encoded image, its draws seeded by the
        sample's key; the process's own generators are left as they were (with no workers they are the
        training step's)."""
        if self.transform is None:  # any transform: it draws from torch's CPU generator
            image = decode_image(data)
            with torch.random.fork_rng(devices=[]):
                # not torch.manual_seed: in a worker it also records a stack trace for the lazy CUDA
                # seeding, about 1 ms per sample (docs/benchmarks.md, data loading)
                torch.default_generator.manual_seed(seed)
                return self.preprocess(image)
        generator = torch.Generator().manual_seed(seed)
        if self.decode_device is not None:
            return self.transform.device_plan(data, generator)
        return self.transform(data, generator)

    def batch(self, images: tuple) -> Tensor | list:
        """A batch of :meth:`crop`'s images as the workers hand it over: stacked, or a list to decode on
        the device."""
        return list(images) if self.decode_device is not None else torch.stack(images)

    def onto_device(self, images: Tensor | list, device: torch.device) -> Tensor:
        """A batch's images on ``device``, not yet normalised (TrainLoader.onto_device)."""
        if isinstance(images, list):
            return decode_on_device(images, self.transform, device)
        return images.to(device, non_blocking=True)

    def model_input(self, images: Tensor, dtype: torch.dtype) -> Tensor:
        """Images from :meth:`onto_device` as the model takes them: normalised (uint8), or cast."""
        if images.dtype != torch.uint8:
            return images.to(dtype=dtype)
        return normalize(images, self.transform.mean, self.transform.std, dtype)
