"""What any loader pays: decoding alone, and each stage of a sample's path (one process, bytes in memory)."""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable
from typing import Any

import PIL.Image
import PIL.ImageEnhance
import torch

from benchmarks.data_shards import read_samples
from eva_fastclip.data.tar_reader import decode_image


def decode_floor(url: str, limit: int) -> dict[str, Any]:
    """Samples per CPU-second of decoding alone (the bytes in memory, no crop), one process."""
    from torchvision.io import ImageReadMode, decode_jpeg

    jpegs = [data for data, _ in read_samples(url)[:limit]]
    decoders: dict[str, Callable[[bytes], Any]] = {
        "pil": decode_image,
        "torchvision": lambda data: decode_jpeg(
            torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB
        ),
    }
    pixels = [math.prod(PIL.Image.open(io.BytesIO(data)).size) for data in jpegs]
    result: dict[str, Any] = {
        "samples": len(jpegs),
        "mean_jpeg_kib": sum(map(len, jpegs)) / len(jpegs) / 1024,
        "mean_megapixels": sum(pixels) / len(pixels) / 1e6,
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, decode in decoders.items():
            cpu0 = time.process_time()
            for data in jpegs:
                decode(data)
            result[f"{name}_samples_per_cpu_s"] = len(jpegs) / max(time.process_time() - cpu0, 1e-9)
    finally:
        torch.set_num_threads(threads)
    return result


#: the stages of a sample, in the order the report lists them: OpenCLIP's per-sample path, then ours
STAGES = (
    ("openclip_decode", "OpenCLIP: PIL decode, RGB"),
    ("openclip_crop_resize", "OpenCLIP: RandomResizedCrop (PIL)"),
    ("openclip_to_tensor", "OpenCLIP: ToTensor"),
    ("openclip_normalize", "OpenCLIP: Normalize"),
    ("openclip_tokenize", "OpenCLIP: tokenize one caption"),
    ("ours_image", "ours: decode, crop, resize to uint8"),
    ("ours_tokenize", "ours: tokenize a batch, per sample"),
)


def stage_times(url: str, limit: int, preprocess, tokenizer, batch_size: int) -> dict[str, float]:
    """CPU milliseconds per sample of each stage in :data:`STAGES`, one thread, the bytes in memory: where
    a loader's time goes, beside what the whole loaders measure. ``preprocess``: open_clip's training
    Compose (:func:`training_transform` checks it)."""
    from eva_fastclip.data.image_transform import TrainImageTransform

    crop, *_, to_tensor, normalize = preprocess.transforms
    ours = TrainImageTransform.from_preprocess(preprocess)
    samples = read_samples(url)[:limit]
    spent = dict.fromkeys([key for key, _ in STAGES], 0.0)

    def timed(key: str, fn, *args):
        start = time.thread_time()
        out = fn(*args)
        spent[key] += time.thread_time() - start
        return out

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i, (data, caption) in enumerate(samples):
            image = timed("openclip_decode", decode_image, data)
            image = timed("openclip_crop_resize", crop, image)
            tensor = timed("openclip_to_tensor", to_tensor, image)
            timed("openclip_normalize", normalize, tensor)
            timed("openclip_tokenize", tokenizer, [caption])
            timed("ours_image", ours, data, torch.Generator().manual_seed(i))
        for start in range(0, len(samples), batch_size):
            timed("ours_tokenize", tokenizer, [caption for _, caption in samples[start : start + batch_size]])
    finally:
        torch.set_num_threads(threads)
    return {key: 1000 * seconds / len(samples) for key, seconds in spent.items()}
