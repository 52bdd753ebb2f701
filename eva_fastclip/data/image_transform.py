"""open_clip's training image transform, split into a worker part (uint8 out) and a device part.

open_clip's training Compose is RandomResizedCrop -> convert("RGB") -> ToTensor -> Normalize, run on a
PIL image. :class:`TrainImageTransform` recognises it (:meth:`~TrainImageTransform.from_preprocess`) and
runs the same augmentation in two halves:

- in the loader worker: decode, draw the crop box, crop and resize, uint8 ``[3, H, W]`` out. A uint8
  image is 4x fewer bytes through the workers' shared memory than float32 (150 KB, not 602 KB, at 224 px);
- on the device: :func:`normalize`, ToTensor's and Normalize's arithmetic exactly, a trivial batched op.

The crop box is torchvision's ``RandomResizedCrop.get_params`` drawing from a per-sample
``torch.Generator`` (:meth:`~TrainImageTransform.crop_box`): the same draws as under ``torch.manual_seed``
with the same seed, so the augmentation distribution is open_clip's, not merely similar, at microseconds
instead of ``manual_seed``'s ~0.3-0.9 ms per call in a worker.

Decode and resize paths, chosen by measurement (2-core EPYC, 1 torch thread, ms per sample; whole loaders
in docs/benchmarks.md, "Data loading"):

- JPEG (RGB or grayscale): ``torchvision.io.decode_jpeg`` (libjpeg-turbo, bit-identical to PIL's decode,
  ~15-30% faster), then torchvision's uint8 bicubic/bilinear antialiased resize of the crop (AVX2, 2-10x
  faster than PIL's ``resize``). Where decode_jpeg refuses a file PIL decides instead: it refuses what PIL
  refuses (cut-short files included) and accepts what PIL accepts.
- JPEG whose crop is at least 4 times the output size on both sides: decoded at 1/4 or 1/8 scale by
  libjpeg's DCT scaling (PIL ``draft``), the largest that keeps the scaled crop at least the output size,
  then resized from the crop box mapped into the reduced image (a float box, clamped) by PIL's
  ``resize(box=...)``: torch's resize takes no fractional box, and rounding the box shifts the crop by
  up to half an output pixel.
- Everything else (PNG, WebP, GIF, CMYK JPEG, ...): PIL decode and ``convert("RGB")`` as open_clip's path,
  then the torch resize.

Every path opens the file with PIL first (the header only), so PIL's decompression-bomb limit
(``PIL.Image.MAX_IMAGE_PIXELS``) applies as before.

Tolerances, checked by ``tests/test_image_transform.py`` against open_clip's own Compose on the same crop box:
full-size decode and resize: every pixel within 1 level of 255 where the crop shrinks on both axes (the usual
case) and with bilinear always; bicubic upsampling within 2, and a crop that shrinks on one axis and grows on
the other within 6 on at most 0.1% of the pixels (PIL and torch's uint8 kernel round and clip between their
two passes in a different order); reduced-size decode on photographs (900-1400 px, q95) against the full-size
path on the same box: mean absolute difference < 3 levels and 99th percentile < 20 (measured 0.3-2.8 and 3-18:
libjpeg's DCT scaling is a sharper filter than a bicubic antialias, most where the scaled crop is just the
output size), a change to a model's image embedding far smaller than moving the crop box by 1% of the image.

For decoding on the GPU, :meth:`~TrainImageTransform.device_plan` reads only the JPEG header in the worker
and :func:`decode_on_device` decodes the batch there (nvjpeg has no reduced-size decode: it decodes full
size). On the GPU torch resizes in float and rounds once, without the CPU kernels' clipping between the two
passes: a few pixels in 10,000 differ from the CPU result by several levels (not yet measured on a GPU).
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import PIL.Image
import torch
import torchvision.transforms as T
import torchvision.transforms.v2.functional as F
from torch import Tensor
from torchvision.transforms import InterpolationMode

from .tar_reader import decode_image

try:  # deprecated since torchvision 0.29 (moving to torchcodec): without it every image takes PIL's path
    from torchvision.io import ImageReadMode, decode_jpeg

    # one warning per worker process would only repeat the line above
    warnings.filterwarnings(
        "ignore", message="The image decoding and encoding capabilities of TorchVision are deprecated"
    )
except ImportError:  # pragma: no cover - depends on the installed torchvision
    decode_jpeg = None

_PIL_FILTERS = {InterpolationMode.BICUBIC: PIL.Image.BICUBIC, InterpolationMode.BILINEAR: PIL.Image.BILINEAR}
# libjpeg's scaled decode at 1/8 or 1/4. Not 1/2: with the float-box PIL resize it needs, it was ~18% slower
# than the full decode and torch's resize on ~700-px photographs
_DCT_REDUCTIONS = (8, 4)
_JPEG_EOI = b"\xff\xd9"

Box = tuple[int, int, int, int]  # (top, left, height, width), as RandomResizedCrop.get_params gives it


class EncodedJpeg(NamedTuple):
    """A JPEG left for the device to decode, and its crop box. A named tuple: the DataLoader keeps its type
    through collation (a plain tuple comes out a list) and pins its tensor."""

    data: Tensor  # the file's bytes, 1-D uint8
    box: Box


@dataclass(frozen=True)
class TrainImageTransform:
    """open_clip's training transform split in two: the worker part (decode, random crop, resize: uint8
    out) and the device part (normalize)."""

    size: tuple[int, int]  # (height, width) of the output
    scale: tuple[float, float]
    ratio: tuple[float, float]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: InterpolationMode = InterpolationMode.BICUBIC
    reduced_decode: bool = True  # decode big JPEGs at 1/4 or 1/8 scale where the crop allows it

    def __post_init__(self) -> None:
        if self.interpolation not in _PIL_FILTERS:
            raise ValueError(f"interpolation {self.interpolation} is not bicubic or bilinear")
        # torchvision's float32 log of the aspect range, once (per call it cost ~10% of a 256-px sample)
        log_ratio = tuple(float(r) for r in torch.log(torch.tensor(self.ratio)))
        object.__setattr__(self, "_log_ratio", log_ratio)

    @classmethod
    def from_preprocess(cls, preprocess) -> TrainImageTransform | None:
        """The split of open_clip's training Compose ``preprocess``; None for any other transform (the
        loader then keeps PIL and the Compose: :func:`explain_unrecognised` says why)."""
        if explain_unrecognised(preprocess):
            return None
        crop, normalize = preprocess.transforms[0], preprocess.transforms[-1]
        return cls(
            size=(int(crop.size[0]), int(crop.size[1])),
            scale=tuple(float(s) for s in crop.scale),
            ratio=tuple(float(r) for r in crop.ratio),
            mean=tuple(float(m) for m in normalize.mean),
            std=tuple(float(s) for s in normalize.std),
            interpolation=crop.interpolation,
        )

    def crop_box(self, width: int, height: int, generator: torch.Generator) -> Box:
        """(top, left, height, width): ``RandomResizedCrop.get_params``'s algorithm, every draw from
        ``generator`` (same seed, same draws, same box as under ``torch.manual_seed``)."""
        area = height * width
        log_ratio = self._log_ratio
        for _ in range(10):
            target_area = (
                area * torch.empty(1).uniform_(self.scale[0], self.scale[1], generator=generator).item()
            )
            aspect_ratio = torch.exp(
                torch.empty(1).uniform_(float(log_ratio[0]), float(log_ratio[1]), generator=generator)
            ).item()
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                top = torch.randint(0, height - h + 1, size=(1,), generator=generator).item()
                left = torch.randint(0, width - w + 1, size=(1,), generator=generator).item()
                return top, left, h, w
        # torchvision's fallback: a central crop
        in_ratio = float(width) / float(height)
        if in_ratio < min(self.ratio):
            w = width
            h = int(round(w / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            h = height
            w = int(round(h * max(self.ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, data: bytes, generator: torch.Generator) -> Tensor:
        """Encoded image bytes -> uint8 ``[3, H, W]`` RGB, cropped and resized. Raises where PIL would
        not decode the file."""
        with _open(data) as image:
            box = self.crop_box(*image.size, generator)
            return self._decode_crop_resize(image, data, box)

    def device_plan(self, data: bytes, generator: torch.Generator) -> EncodedJpeg | Tensor:
        """For :func:`decode_on_device`: ``(encoded bytes as 1-D uint8, box)`` for a JPEG the device can
        decode, else the finished uint8 ``[3, H, W]`` image (decoded here, as :meth:`__call__`)."""
        with _open(data) as image:
            box = self.crop_box(*image.size, generator)
            # a file not ending in EOI may be cut short: the worker's decoders refuse those as PIL does
            if decode_jpeg is not None and _fast_jpeg(image) and data.endswith(_JPEG_EOI):
                return EncodedJpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), box)
            return self._decode_crop_resize(image, data, box)

    def _decode_crop_resize(self, image: PIL.Image.Image, data: bytes, box: Box) -> Tensor:
        if image.format == "JPEG":
            reduction = self._reduction(box) if self.reduced_decode else 1
            if reduction > 1:
                return self._reduced_jpeg(image, box, reduction)
            if decode_jpeg is not None and _fast_jpeg(image):
                try:
                    decoded = decode_jpeg(
                        torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB
                    )
                except RuntimeError:
                    pass  # some files libjpeg-turbo refuses PIL reads: let PIL decide below
                else:
                    return self.resize(decoded, box)
        image.load()
        return self.resize(_to_tensor(image.convert("RGB")), box)

    def resize(self, image: Tensor, box: Box) -> Tensor:
        """uint8 ``[3, h, w]`` -> the crop ``box`` resized to :attr:`size`, as torchvision resizes tensors
        (on the CPU its native uint8 kernel; elsewhere float, rounded)."""
        top, left, height, width = box
        resized = F.resized_crop(
            image, top, left, height, width, list(self.size), self.interpolation, antialias=True
        )
        # a box of the output's size comes back as a view of the whole image: not that through shared memory
        return resized.contiguous()

    def _reduction(self, box: Box) -> int:
        """The largest DCT reduction that keeps the scaled crop at least the output size, else 1."""
        _, _, height, width = box
        for reduction in _DCT_REDUCTIONS:
            if height / reduction >= self.size[0] and width / reduction >= self.size[1]:
                return reduction
        return 1

    def _reduced_jpeg(self, image: PIL.Image.Image, box: Box, reduction: int) -> Tensor:
        """Decode at 1/``reduction`` scale and resize from the crop box mapped into the reduced image."""
        full_width, full_height = image.size
        # draft picks the largest of 8, 4, 2 dividing min(W // w, H // h): ask so that it picks `reduction`
        drafted = image.draft("RGB", (full_width // reduction, full_height // reduction))
        image.load()
        # draft's box is the full image in reduced pixels (W / scale: libjpeg maps 8x8 blocks to 8/scale
        # pixels; the reduced size is rounded up, so W / reduced width would be slightly off)
        sx, sy = (drafted[1][2] / full_width, drafted[1][3] / full_height) if drafted else (1.0, 1.0)
        top, left, height, width = box
        reduced_w, reduced_h = image.size
        float_box = (
            min(left * sx, reduced_w),
            min(top * sy, reduced_h),
            min((left + width) * sx, reduced_w),
            min((top + height) * sy, reduced_h),
        )
        rgb = image.convert("RGB")
        resized = rgb.resize((self.size[1], self.size[0]), _PIL_FILTERS[self.interpolation], box=float_box)
        return _to_tensor(resized)


def explain_unrecognised(preprocess) -> str:
    """Why ``preprocess`` is not open_clip's plain training Compose ("" where it is)."""
    steps = getattr(preprocess, "transforms", None)
    if type(preprocess) is not T.Compose or not isinstance(steps, list):
        return f"{type(preprocess).__name__} is not a torchvision Compose"
    names = [type(step).__name__ for step in steps]
    expected = "RandomResizedCrop, [MaybeConvertMode('RGB')], ToTensor/MaybeToTensor, Normalize"
    if len(steps) not in (3, 4):
        return f"steps {names}, not {expected}"
    crop, *middle, to_tensor, normalize = steps
    if type(crop) is not T.RandomResizedCrop:
        return f"first step {names[0]}, not RandomResizedCrop"
    if crop.interpolation not in _PIL_FILTERS:
        return f"RandomResizedCrop interpolation {crop.interpolation}, not bicubic or bilinear"
    if len(crop.size) != 2:
        return f"RandomResizedCrop size {crop.size} is not (height, width)"
    if middle and not (
        type(middle[0]).__name__ == "MaybeConvertMode" and getattr(middle[0], "mode", None) == "RGB"
    ):
        return f"step {names[1]} (augmentation or mode change) after the crop, expected {expected}"
    if type(to_tensor) is not T.ToTensor and type(to_tensor).__name__ != "MaybeToTensor":
        return f"step {names[-2]}, not ToTensor/MaybeToTensor"
    if type(normalize) is not T.Normalize or len(normalize.mean) != 3 or len(normalize.std) != 3:
        return f"last step {names[-1]}, not a 3-channel Normalize"
    return ""


def normalize(images: Tensor, mean, std, dtype: torch.dtype) -> Tensor:
    """uint8 ``[B, 3, H, W]`` -> ``dtype``, with ToTensor's and Normalize's float32 arithmetic exactly
    (``x / 255``, then ``(x - mean) / std``), cast to ``dtype`` last as a float32 batch would be."""
    mean = torch.as_tensor(mean, dtype=torch.float32, device=images.device).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=torch.float32, device=images.device).view(-1, 1, 1)
    return images.to(torch.float32).div_(255).sub_(mean).div_(std).to(dtype)


def decode_on_device(items: list, transform: TrainImageTransform, device: torch.device) -> Tensor:
    """uint8 ``[B, 3, H, W]`` on ``device`` from :meth:`TrainImageTransform.device_plan`'s items: the
    JPEGs decoded there in one call (one by one if the device refuses one), cropped and resized there; the
    finished images moved there."""
    device = torch.device(device)
    jpegs = [i for i, item in enumerate(items) if isinstance(item, EncodedJpeg)]
    out: list[Tensor | None] = [None] * len(items)
    if jpegs:
        if device.type == "cuda":
            # nvjpeg writes on a stream of its own without waiting for ours: memory the allocator freed
            # under kernels still queued (the previous micro-batch's backward) must be free indeed
            torch.cuda.current_stream(device).synchronize()
        encoded = [items[i].data for i in jpegs]
        try:
            decoded = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
        except torch.OutOfMemoryError:
            raise  # a RuntimeError too, but no file's fault
        except RuntimeError:  # one file the device refuses fails the whole call: decode one by one
            decoded = [_decode_one(items[i].data, device) for i in jpegs]
        for i, image in zip(jpegs, decoded):
            out[i] = transform.resize(image.to(device), items[i].box)
    for i, item in enumerate(items):
        if out[i] is None:
            out[i] = item.to(device, non_blocking=True)
    return torch.stack(out)


def _decode_one(data: Tensor, device: torch.device) -> Tensor:
    """One JPEG on ``device``, or, where the device refuses it (arithmetic-coded, lossless, a damaged
    scan), decoded here by PIL and moved there."""
    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as device_error:
        try:
            return _to_tensor(decode_image(data.numpy().tobytes())).to(device)
        except (OSError, ValueError) as err:
            raise RuntimeError(
                f"data.image_decode=gpu: a JPEG of this batch decodes neither on {device} ({device_error}) "
                f"nor with PIL ({err}); data.image_decode=workers skips and counts such samples"
            ) from err


def _open(data: bytes) -> PIL.Image.Image:
    """The image with only its header read: format, mode, size (and PIL's decompression-bomb check)."""
    return PIL.Image.open(io.BytesIO(data))


def _fast_jpeg(image: PIL.Image.Image) -> bool:
    """A JPEG decode_jpeg turns into the RGB that PIL's convert("RGB") gives (CMYK goes through PIL)."""
    return image.format == "JPEG" and image.mode in ("RGB", "L")


def _to_tensor(image: PIL.Image.Image) -> Tensor:
    """An RGB PIL image as uint8 ``[3, H, W]``."""
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).contiguous()
