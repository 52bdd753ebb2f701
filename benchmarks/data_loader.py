"""`eva-fastclip bench-data`: our training loader against OpenCLIP's own webdataset loader, on the same
shards, with the same transform, batch and worker count, side by side in one run; and the decode-only
floor that any loader pays.

- **Shards**: real photographs, offline: scikit-learn's two sample photos (640x427) cut into thousands of
  distinct JPEGs (seeded random crops of 10-100% of the area, random aspect 3/4-4/3 and position, flips,
  small colour and brightness changes), JPEG quality 95, in img2dataset's layout (``00000.tar`` with
  ``<key>.jpg/.txt/.json``, ``00000_stats.json``). Two kinds of the same crops: ``256px`` (shorter side
  256, img2dataset's keep-ratio resize) and ``original`` (longer side 640-1024 px: the crops are upscaled,
  since the photos themselves are only 640 px wide). Written once under ``--data`` and reused.
- **openclip**: ``open_clip_train.data.get_wds_dataset``, its real code. Two pieces are patched so that it
  runs here, nothing else: (1) its ``group_by_keys_nothrow`` reads ``filesample["fname"]`` from every item
  and so raises ``KeyError: 'fname'`` on the empty end-of-shard marker (``{}``) that webdataset 1.0's
  ``tar_file_expander`` yields after each shard; for the run it is replaced by webdataset's own
  ``tariterators.group_by_keys`` (the same grouping; it ends a sample at the marker and, on a duplicate
  member, hands the error to OpenCLIP's ``log_and_continue``; our shards have none). (2) Where pandas is not
  installed, ``open_clip_train.data`` is imported with a placeholder for it: only its CSV dataset uses it.
- **ours**: :class:`eva_fastclip.data.TrainLoader`, ``needs_index=False``, whatever it yields (the table
  gives the image dtype and bytes per batch: uint8 images are normalised on the device in training, which
  is not loader CPU).
- **floor**: one process, the JPEG bytes already in memory, decode only (PIL to RGB, and
  ``torchvision.io.decode_jpeg``), no crop.

Both loaders get the model's open_clip training transform (built from its config, as
``create_model_and_transforms`` builds it, without building the model: see :func:`training_transform`) and
its tokenizer. Each run reads one epoch: the first ``warmup`` batches (worker start, the shuffle
buffer filling) are not timed, then ``batches`` batches are. Measured over that window: samples per second
of wall time, and samples per CPU-second of the whole loader, the CPU time (utime + stime from
``/proc/<pid>/stat``) of the main process and of every DataLoader worker, read at both ends of the window
while the workers are alive (``getrusage(RUSAGE_CHILDREN)`` would count them only after they exit, and not
the window alone). A thread samples the workers' memory: peak RSS (the kernel's ``VmHWM``) and peak private
memory (``Private_Clean + Private_Dirty`` of ``smaps_rollup``: what the worker adds to the machine). The
runs of the two loaders alternate (ABAB, then BABA), and the report gives the rates' medians over ``repeats``
and the memory of the worst run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import io
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import PIL.ImageEnhance
import torch

from benchmarks.speed import cpu_model
from eva_fastclip.data.shards import write_shard
from eva_fastclip.data.tar_reader import decode_image
from eva_fastclip.data.workers import start_worker_server

logger = logging.getLogger(__name__)

KINDS = ("256px", "original")
#: with --device: ours again, the workers handing JPEG bytes for the device to decode (data.image_decode=gpu)
DEVICE_DECODE = "ours_device_decode"
SHARDS_RECORD = "bench_shards.json"
_SHARDS_VERSION = 2  # bump when the shards written change
_JPEG_QUALITY = 95
_ORIGINAL_LONG_SIDE = (640, 1024)
_SUBJECTS = {"china": ("a temple", "a pagoda", "a building", "a roof"), "flower": ("a flower", "a dahlia")}
_TEMPLATES = (
    "a photo of {}",
    "{} in the sun",
    "a close-up of {}",
    "a cropped picture of {}",
    "{}, seen from nearby",
    "an image showing {}",
)
_ADJECTIVES = ("", "bright ", "colourful ", "old ", "small ", "large ")


# ---- shards ---------------------------------------------------------------------------------------------


def bench_shards(root: str | Path, shards: int, per_shard: int, seed: int = 0) -> dict[str, list[str]]:
    """The shard paths of both kinds under ``root``, written first unless ``root`` holds them with the same
    settings (its ``bench_shards.json`` says which)."""
    root = Path(root)
    settings = {"version": _SHARDS_VERSION, "shards": shards, "per_shard": per_shard, "seed": seed}
    paths = {kind: [str(root / kind / f"{n:05d}.tar") for n in range(shards)] for kind in KINDS}
    record = root / SHARDS_RECORD
    if record.exists() and all(Path(p).exists() for kind in KINDS for p in paths[kind]):
        with contextlib.suppress(ValueError):
            if json.loads(record.read_text()) == settings:
                return paths
    record.unlink(missing_ok=True)  # a half-written set must not look complete
    # Written by a process of its own: a worker forked later shares this process's heap, and each page of
    # it that this process rewrites afterwards becomes the worker's private copy, so the samples' freed
    # memory would count as worker memory that no loader allocated.
    job = json.dumps({"root": str(root), "paths": paths, "per_shard": per_shard, "seed": seed})
    write = "import json, sys\nfrom benchmarks.data_loader import _write_bench_shards as w\n"
    subprocess.run([sys.executable, "-c", write + "w(**json.loads(sys.argv[1]))", job], check=True)
    record.write_text(json.dumps(settings))
    return paths


def _write_bench_shards(root: str, paths: dict[str, list[str]], per_shard: int, seed: int) -> None:
    root, shards = Path(root), len(paths[KINDS[0]])
    photos = _sample_photos()
    for kind in KINDS:
        (root / kind).mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    with tqdm(total=shards * per_shard, desc=f"writing loader benchmark shards to {root}") as bar:
        for shard in range(shards):
            samples: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
            for row in range(per_shard):
                key = f"{shard:05d}{row:04d}"  # img2dataset: shard id, then the row in it
                rng = np.random.default_rng([seed, shard, row])
                name, crop = _random_crop(rng, photos)
                caption = rng.choice(_TEMPLATES).format(rng.choice(_ADJECTIVES) + rng.choice(_SUBJECTS[name]))
                for kind in KINDS:
                    jpeg, size = _encode(_resize(crop, kind, rng))
                    meta = {"key": key, "caption": caption, "status": "success", "width": size[0]}
                    meta["height"] = size[1]
                    samples[kind].append({"__key__": key, "jpg": jpeg, "txt": caption, "json": meta})
                bar.update(1)
            for kind in KINDS:
                count = write_shard(paths[kind][shard], samples[kind])
                stats = {"count": count, "successes": count, "failed_to_download": 0, "failed_to_resize": 0}
                Path(paths[kind][shard]).with_name(f"{shard:05d}_stats.json").write_text(json.dumps(stats))


def _sample_photos() -> dict[str, PIL.Image.Image]:
    from sklearn.datasets import load_sample_images

    bunch = load_sample_images()
    return {
        Path(file).stem.split(".")[0]: PIL.Image.fromarray(image)
        for file, image in zip(bunch.filenames, bunch.images)
    }


def _random_crop(rng: np.random.Generator, photos: dict[str, PIL.Image.Image]) -> tuple[str, PIL.Image.Image]:
    """A crop of 10-100% of a photo's area, aspect 3/4-4/3, anywhere in it, maybe flipped, its colour and
    brightness changed a little."""
    name = sorted(photos)[rng.integers(len(photos))]
    photo = photos[name]
    area = photo.width * photo.height * rng.uniform(0.1, 1.0)
    aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
    w = min(photo.width, round(math.sqrt(area * aspect)))
    h = min(photo.height, round(math.sqrt(area / aspect)))
    x, y = int(rng.integers(photo.width - w + 1)), int(rng.integers(photo.height - h + 1))
    crop = photo.crop((x, y, x + w, y + h))
    if rng.random() < 0.5:
        crop = crop.transpose(PIL.Image.Transpose.FLIP_LEFT_RIGHT)
    crop = PIL.ImageEnhance.Color(crop).enhance(rng.uniform(0.8, 1.2))
    return name, PIL.ImageEnhance.Brightness(crop).enhance(rng.uniform(0.85, 1.15))


def _resize(image: PIL.Image.Image, kind: str, rng: np.random.Generator) -> PIL.Image.Image:
    # 256px: img2dataset's --resize_mode keep_ratio, the shorter side to 256; original: a camera-sized
    # picture, the longer side 640-1024 px
    long_side = rng.uniform(*_ORIGINAL_LONG_SIDE)
    scale = 256 / min(image.size) if kind == "256px" else long_side / max(image.size)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    return image.resize(size, PIL.Image.Resampling.LANCZOS)


def _encode(image: PIL.Image.Image) -> tuple[bytes, tuple[int, int]]:
    with io.BytesIO() as out:
        image.save(out, format="JPEG", quality=_JPEG_QUALITY)
        return out.getvalue(), image.size


def read_samples(url: str) -> list[tuple[bytes, str]]:
    """The (JPEG bytes, caption) pairs of a shard, in its order."""
    import tarfile

    members: dict[str, dict[str, bytes]] = {}
    with tarfile.open(url) as tar:
        for member in tar.getmembers():
            key, _, extension = member.name.rpartition(".")
            if extension in ("jpg", "txt"):
                members.setdefault(key, {})[extension] = tar.extractfile(member).read()
    return [(parts["jpg"], parts["txt"].decode("utf-8")) for parts in members.values() if len(parts) == 2]


# ---- the loaders ----------------------------------------------------------------------------------------


class _Missing(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        raise ImportError(
            f"{self.__name__} is not installed (bench-data imported open_clip_train without it)"
        )


def _openclip_data() -> types.ModuleType:
    """``open_clip_train.data``; where pandas is missing, imported with a placeholder for it (only its CSV
    dataset, which this benchmark does not use, needs pandas)."""
    try:
        import open_clip_train.data as data
    except ModuleNotFoundError as exn:
        if exn.name != "pandas":
            raise
        sys.modules["pandas"] = _Missing("pandas")
        try:
            import open_clip_train.data as data
        finally:
            del sys.modules["pandas"]
    return data


@contextlib.contextmanager
def openclip_patched() -> Iterator[types.ModuleType]:
    """``open_clip_train.data`` with its ``group_by_keys_nothrow`` replaced by webdataset's
    ``group_by_keys`` while the context lasts (it raises KeyError 'fname' on webdataset 1.0's end-of-shard
    marker); the original is put back after."""
    from webdataset.tariterators import group_by_keys

    data = _openclip_data()
    original = data.group_by_keys_nothrow
    data.group_by_keys_nothrow = group_by_keys
    try:
        yield data
    finally:
        data.group_by_keys_nothrow = original


def openclip_batches(urls: list[str], preprocess, tokenizer, batch_size: int, workers: int, seed: int):
    """OpenCLIP's training loader (``get_wds_dataset``, as open_clip_train's ``get_data`` calls it for
    ``--dataset-type webdataset``) over ``urls``, and its batches per epoch. Call it inside
    :func:`openclip_patched` and iterate it there: its workers start with the first iteration."""
    data = _openclip_data()
    args = argparse.Namespace(
        train_data="::".join(urls),
        val_data=None,
        train_num_samples=sum(_stats_successes(url) for url in urls),  # its --train-num-samples
        dataset_resampled=False,
        train_data_upsampling_factors=None,
        batch_size=batch_size,
        workers=workers,
        world_size=1,
        seed=seed,
    )
    info = data.get_wds_dataset(args, preprocess, is_train=True, epoch=0, tokenizer=tokenizer)
    return info.dataloader, info.dataloader.num_batches


def our_batches(
    urls: list[str],
    preprocess,
    tokenizer,
    batch_size: int,
    workers: int,
    seed: int,
    shuffle_buffer: int = 1000,
    decode_device: str | None = None,
    pin_memory: bool = False,
):
    """Our training loader over ``urls`` (no per-sample state, so no index is needed), and its batches
    per epoch; with ``decode_device`` the workers hand over JPEG bytes (``data.image_decode=gpu``)."""
    from eva_fastclip.data import TrainLoader

    loader = TrainLoader(
        urls,
        preprocess=preprocess,
        tokenize=tokenizer,
        batch_size=batch_size,
        workers=workers,
        seed=seed,
        needs_index=False,
        shuffle_buffer=shuffle_buffer,
        decode_device=decode_device,
        pin_memory=pin_memory,
    )
    return loader, loader.num_batches


def on_device(loader, device: torch.device) -> Iterator[tuple]:
    """``loader``'s batches, each also made into the model's float32 input on ``device`` as the trainer
    makes it (ours: ``TrainLoader.to_device``, normalised or decoded there; OpenCLIP's: a copy), and
    waited for; the host batch is yielded, so that the report says what crossed shared memory."""
    for batch in loader:
        images, tokens = batch[0], batch[1]
        if hasattr(loader, "to_device"):
            loader.to_device(images, device, torch.float32)
        else:
            images.to(device, dtype=torch.float32, non_blocking=True)
        tokens.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        yield batch


def _stats_successes(url: str) -> int:
    stats = Path(url).with_name(Path(url).name.replace(".tar", "_stats.json"))
    return int(json.loads(stats.read_text())["successes"])


# ---- measuring ------------------------------------------------------------------------------------------

_TICKS = os.sysconf("SC_CLK_TCK")


def _children() -> list[int]:
    """This process's descendants: the DataLoader workers are its children (fork) or its fork server's
    (ours, data/workers.py; the server, started with the loader, is among the processes left out)."""
    pids: list[int] = []
    parents = ["self"]
    while parents:
        parent = parents.pop()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{parent}/task"):
                with contextlib.suppress(OSError):
                    found = [int(p) for p in Path(f"/proc/{parent}/task/{task}/children").read_text().split()]
                    pids += found
                    parents += found
    return pids


def _cpu_seconds(pid: int | str) -> float:
    """utime + stime of a process (all its threads), in seconds; 0 for one that has exited."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _memory_mib(pid: int) -> tuple[float, float]:
    """(peak RSS, current private memory) of a process, MiB; zeros for one that has exited."""
    peak = private = 0.0
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                private += int(line.split()[1]) / 1024
    return peak, private


class _MemorySampler:
    """Samples the worker processes' memory every ``interval`` seconds on a thread of its own."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.others = set(_children())  # processes started before: not the loader's
        self.peak_rss: dict[int, float] = {}
        self.peak_private: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        for pid in set(_children()) - self.others:
            rss, private = _memory_mib(pid)
            self.peak_rss[pid] = max(self.peak_rss.get(pid, 0.0), rss)
            self.peak_private[pid] = max(self.peak_private.get(pid, 0.0), private)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()


def wait_for_workers_to_exit(others: set[int] = frozenset(), timeout: float = 30.0) -> None:
    """Wait until this process has no children but ``others`` (started before the loader's workers)."""
    gc.collect()  # a persistent loader's workers stop when its iterator is collected
    deadline = time.monotonic() + timeout
    while set(_children()) - set(others) and time.monotonic() < deadline:
        time.sleep(0.05)


def measure(batches: Iterable, warmup: int, timed: int, workers: int) -> dict[str, Any]:
    """Read ``warmup + timed`` batches and measure the last ``timed``: wall time, the CPU time of this
    process and its workers, the workers' peak memory, and what a batch is. The caller stops the workers
    (drops the loader) and waits for them to exit (:func:`wait_for_workers_to_exit`)."""
    if warmup < 1 or timed < 1:
        raise ValueError(f"warm-up batches ({warmup}) and timed batches ({timed}) must be at least 1")
    others = set(_children())  # processes this one had started before: not the loader's
    iterator = iter(batches)
    samples = 0
    with _MemorySampler() as sampler:
        for i in range(warmup + timed):
            batch = next(iterator, None)
            if batch is None:
                raise ValueError(f"the loader ended after {i} batches; {warmup + timed} were asked for")
            if i == 0:
                images, tokens = batch[0], batch[1]
            if i == warmup - 1:  # the window starts once the warm-up batches are in
                pids = sorted(set(_children()) - others)
                cpu0 = _cpu_seconds("self") + sum(_cpu_seconds(pid) for pid in pids)
                wall0 = time.perf_counter()
            elif i >= warmup:
                samples += len(batch[0])
        wall = time.perf_counter() - wall0
        cpu = _cpu_seconds("self") + sum(_cpu_seconds(pid) for pid in pids) - cpu0
        sampler.sample()  # the workers are alive until the iterator is dropped
        at_end = sorted(set(_children()) - others)
        if len(pids) != workers or at_end != pids:
            raise RuntimeError(
                f"expected the loader's {workers} worker processes throughout the timed batches, found "
                f"{pids} at its start and {at_end} at its end (read from /proc/self/task/*/children)"
            )
    with contextlib.suppress(AttributeError):
        iterator.close()  # a generator (ours): ends its DataLoader iterator, which stops the workers
    return {
        "samples": samples,
        "wall_s": wall,
        "cpu_s": cpu,
        "samples_per_s": samples / wall,
        "samples_per_cpu_s": samples / max(cpu, 1e-9),
        "workers": len(pids),
        "worker_peak_rss_mib": max(sampler.peak_rss.values(), default=0.0),
        "worker_peak_private_mib": max(sampler.peak_private.values(), default=0.0),
        **_describe_images(images),
        "token_shape": list(tokens.shape),
        "batch_bytes": _image_bytes(images) + tokens.element_size() * tokens.numel(),
    }


def _describe_images(images) -> dict[str, Any]:
    """A batch's images as the report names them: a tensor, or (``data.image_decode=gpu``) a list of
    encoded JPEGs and finished uint8 images."""
    if isinstance(images, torch.Tensor):
        return {"image_dtype": str(images.dtype).removeprefix("torch."), "image_shape": list(images.shape)}
    return {"image_dtype": "JPEG bytes", "image_shape": [len(images)]}


def _image_bytes(images) -> int:
    if isinstance(images, torch.Tensor):
        return images.element_size() * images.numel()
    return sum(_image_bytes(getattr(item, "data", item)) for item in images)


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


# ---- the benchmark --------------------------------------------------------------------------------------


def training_transform(model: str):
    """open_clip's training transform of ``model``, built from its config without building the model: a
    model created and freed in this process leaves a heap that the parent rewrites after the workers fork,
    and those pages would count as the workers' private memory."""
    import open_clip

    config = open_clip.get_model_config(model)
    if config is None:
        raise ValueError(f"--model {model!r} is not an open_clip architecture: see open_clip.list_models()")
    options = {
        k: v
        for k, v in config.get("preprocess_cfg", {}).items()
        if k in ("mean", "std", "interpolation", "resize_mode")
    }
    transform = open_clip.image_transform(config["vision_cfg"]["image_size"], is_train=True, **options)
    from eva_fastclip.data.image_transform import TrainImageTransform, explain_unrecognised

    if TrainImageTransform.from_preprocess(transform) is None:  # before any work, not after the runs
        raise ValueError(
            f"--model {model}: its training transform is not one ours takes apart: "
            f"{explain_unrecognised(transform)}"
        )
    return transform


def run_data_benchmark(
    data: str | Path = "data/bench_loader",
    output: str | Path = "runs/bench/data",
    *,
    shards: int = 6,
    per_shard: int = 1000,
    batch_size: int = 64,
    workers: Iterable[int] = (1,),
    repeats: int = 3,
    warmup: int = 5,
    batches: int | None = None,
    kinds: Iterable[str] = KINDS,
    model: str = "ViT-B-16",
    floor_samples: int = 500,
    shuffle_buffer: int = 1000,
    seed: int = 0,
    device: str | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """Every (shard kind, worker count): ``repeats`` runs of each loader, alternating, and the decode
    floor; the results are written under ``output`` (``data_loader.json``, ``data_loader.md``).

    With ``device`` every batch is also made into the model's input there, as the trainer makes it, and
    a third loader runs: ours with the JPEGs decoded on ``device`` (``data.image_decode=gpu``)."""
    import open_clip

    target = _check_device(device)
    workers, kinds = list(workers), list(kinds)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown shard kinds {unknown} (--kinds): choose from {list(KINDS)}")
    if any(w < 1 for w in workers) or any(shards % w for w in workers):
        raise ValueError(
            f"--workers {workers} must each be >= 1 and divide --shards {shards}: OpenCLIP gives each worker "
            "whole shards, and uneven shares would leave one worker idle at the end of its epoch"
        )
    timed = {}  # workers -> batches to time: both loaders hold them after the warm-up
    for w in workers:
        whole = w * (shards // w * per_shard // batch_size)  # full batches of w workers' equal shares
        timed[w] = batches or whole - warmup - 2 * w  # the default leaves each worker two to spare
        if warmup < 1 or timed[w] < 1 or warmup + timed[w] > whole:
            raise ValueError(
                f"--warmup {warmup} and --batches {timed[w]} must be >= 1 and fit in the {whole} full "
                f"batches of {batch_size} that {w} worker(s) read from {shards} x {per_shard} samples: "
                "change --warmup/--batches, or raise --shards/--per-shard"
            )
    paths = bench_shards(data, shards, per_shard, seed)
    preprocess = training_transform(model)
    tokenizer = open_clip.get_tokenizer(model)
    pin = target is not None and target.type == "cuda"  # as the trainer pins for a GPU
    loaders = {
        "ours": functools.partial(our_batches, shuffle_buffer=shuffle_buffer, pin_memory=pin),
        "openclip": openclip_batches,
    }
    if target is not None:
        loaders[DEVICE_DECODE] = functools.partial(
            our_batches, shuffle_buffer=shuffle_buffer, decode_device=target, pin_memory=pin
        )
    names = tuple(loaders)

    runs: list[dict[str, Any]] = []
    start_worker_server()  # our workers' fork server, once: among the processes each run leaves out
    for kind in kinds:
        for w in workers:
            for repeat in range(repeats):
                order = names if repeat % 2 == 0 else names[::-1]
                for name in order:
                    others = set(_children())  # e.g. multiprocessing's resource tracker
                    with openclip_patched() if name == "openclip" else contextlib.nullcontext():
                        loader, _ = loaders[name](paths[kind], preprocess, tokenizer, batch_size, w, seed)
                        batches = loader if target is None else on_device(loader, target)
                        result = measure(batches, warmup, timed[w], workers=w)
                        del batches
                    del loader  # a persistent DataLoader (OpenCLIP's) keeps its workers while it lives
                    wait_for_workers_to_exit(others)
                    result.update(kind=kind, loader=name, workers=w, repeat=repeat)
                    runs.append(result)
                    logger.info(
                        "%s, %d worker(s), %s, run %d: %.1f samples/s, %.1f samples/CPU-s, worker peak RSS "
                        "%.0f MiB, private %.0f MiB", kind, w, name, repeat, result["samples_per_s"],
                        result["samples_per_cpu_s"], result["worker_peak_rss_mib"],
                        result["worker_peak_private_mib"],
                    )  # fmt: skip
    # after every loader run: the bytes it reads would otherwise stay in the heap that workers fork from
    floor: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        floor[kind] = {"runs": [decode_floor(paths[kind][0], floor_samples) for _ in range(repeats)]}
        floor[kind].update(_floor_summary(floor[kind]["runs"]))
        stages = stage_times(paths[kind][0], floor_samples, preprocess, tokenizer, batch_size)
        floor[kind]["stages_ms"] = stages

    results = {
        "what": "training loader throughput: ours (TrainLoader) against OpenCLIP's get_wds_dataset",
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
        "versions": _versions(),
        "settings": {
            "model": model,
            "batch_size": batch_size,
            "workers": workers,
            "repeats": repeats,
            "warmup_batches": warmup,
            "shards": shards,
            "per_shard": per_shard,
            "data": str(data),
            "device": None if target is None else str(target),
        },
        "shuffle_buffer": {
            "ours": f"{shuffle_buffer} samples per worker (data.shuffle_buffer), encoded bytes",
            "openclip": "5000 samples per worker (1000 before the first), encoded bytes; shards: 2000",
        },
        "openclip_patched": "open_clip_train.data.group_by_keys_nothrow := "
        "webdataset.tariterators.group_by_keys",
        "runs": runs,
        "summary": _summary(runs),
        "floor": floor,
    }
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data_loader.json").write_text(json.dumps(results, indent=2))
    (out / "data_loader.md").write_text(format_data_report(results) + "\n")
    results["output"] = str(out)
    return results


def _check_device(device: str | None) -> torch.device | None:
    """``--device`` as a torch device; ValueError, before any work, for one this machine does not have."""
    if device is None:
        return None
    try:
        target = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"--device {device!r}: {err}") from None
    if target.type not in ("cuda", "cpu"):
        raise ValueError(
            f"--device {device}: cuda or cpu (cpu runs the device path on the CPU, as the tests do)"
        )
    if target.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise ValueError(
                f"--device {device}: torch sees no CUDA GPU here (without --device: the loaders alone)"
            )
        if target.index is not None and target.index >= count:
            raise ValueError(f"--device {device}: torch sees {count} GPU(s), cuda:0 to cuda:{count - 1}")
        # CUDA starts now, not in the first timed run: every loader's workers fork from the same parent
        torch.zeros(1, device=target)
    return target


def _summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (kind, workers, loader): the rates' medians, the worst run's memory; and ours / OpenCLIP."""
    rows = []
    for kind in dict.fromkeys(r["kind"] for r in runs):
        for w in dict.fromkeys(r["workers"] for r in runs if r["kind"] == kind):
            row: dict[str, Any] = {"kind": kind, "workers": w}
            for name in dict.fromkeys(r["loader"] for r in runs):
                mine = [r for r in runs if (r["kind"], r["workers"], r["loader"]) == (kind, w, name)]
                row[name] = {
                    key: statistics.median(r[key] for r in mine)
                    for key in ("samples_per_s", "samples_per_cpu_s")
                } | {
                    # memory: the worst run, a bound (the rates: medians)
                    "worker_peak_rss_mib": max(r["worker_peak_rss_mib"] for r in mine),
                    "worker_peak_private_mib": max(r["worker_peak_private_mib"] for r in mine),
                    "image_dtype": mine[0]["image_dtype"],
                    "batch_bytes": mine[0]["batch_bytes"],
                    "samples": mine[0]["samples"],
                }
            for key in ("samples_per_s", "samples_per_cpu_s"):
                row[f"ratio_{key}"] = row["ours"][key] / row["openclip"][key]
                if DEVICE_DECODE in row:
                    row[f"device_decode_ratio_{key}"] = row[DEVICE_DECODE][key] / row["openclip"][key]
            rows.append(row)
    return rows


def _floor_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "samples"}


def format_data_report(results: dict[str, Any]) -> str:
    """The results as markdown: the settings, one row per (kind, workers), the floor."""
    s = results["settings"]
    lines = [
        f"{results['what']}; {results['date']}, {results['machine']['cpu']} ({results['machine']['cores']} "
        f"cores), torch {results['versions']['torch']}, webdataset {results['versions']['webdataset']}, "
        f"open_clip {results['versions']['open_clip']}; {s['model']} transform, batch {s['batch_size']}, "
        f"{s['shards']} x {s['per_shard']} samples per shard kind; rates: medians of {s['repeats']} runs, "
        "memory: the largest"
        + (
            f"; every batch also made into float32 model input on {s['device']}, as the trainer makes it, "
            "and waited for."
            if s.get("device")
            else "; the loaders alone (normalising ours on the device is not in these figures)."
        ),
        "",
        "| shards | workers | ours samples/s | OpenCLIP samples/s | ours / OpenCLIP | ours samples/CPU-s | "
        "OpenCLIP samples/CPU-s | ours / OpenCLIP per CPU-s | ours batch | OpenCLIP batch | "
        "worker peak RSS MiB ours / OpenCLIP | worker peak private MiB ours / OpenCLIP |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["summary"]:
        ours, oc = row["ours"], row["openclip"]
        lines.append(
            f"| {row['kind']} | {row['workers']} | {ours['samples_per_s']:.0f} | {oc['samples_per_s']:.0f} | "
            f"{row['ratio_samples_per_s']:.2f} | {ours['samples_per_cpu_s']:.0f} | "
            f"{oc['samples_per_cpu_s']:.0f} | "
            f"**{row['ratio_samples_per_cpu_s']:.2f}** | {_batch(ours)} | {_batch(oc)} | "
            f"{ours['worker_peak_rss_mib']:.0f} / {oc['worker_peak_rss_mib']:.0f} | "
            f"{ours['worker_peak_private_mib']:.0f} / {oc['worker_peak_private_mib']:.0f} |"
        )
    if s.get("device"):
        lines += [
            "",
            f"Ours with the JPEGs decoded on {s['device']} (data.image_decode=gpu; the workers read the "
            "bytes and draw the crop boxes):",
            "",
            "| shards | workers | samples/s | / OpenCLIP | samples/CPU-s | / OpenCLIP per CPU-s | batch | "
            "worker peak RSS MiB |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in results["summary"]:
            d = row[DEVICE_DECODE]
            lines.append(
                f"| {row['kind']} | {row['workers']} | {d['samples_per_s']:.0f} | "
                f"{row['device_decode_ratio_samples_per_s']:.2f} | {d['samples_per_cpu_s']:.0f} | "
                f"**{row['device_decode_ratio_samples_per_cpu_s']:.2f}** | {_batch(d)} | "
                f"{d['worker_peak_rss_mib']:.0f} |"
            )
    lines += [
        "",
        "Decode-only floor (one process, bytes in memory, no crop), samples per CPU-second:",
        "",
        "| shards | mean JPEG KiB | mean megapixels | PIL decode | torchvision decode_jpeg |",
        "|---|---|---|---|---|",
    ]
    for kind, f in results["floor"].items():
        lines.append(
            f"| {kind} | {f['mean_jpeg_kib']:.0f} | {f['mean_megapixels']:.2f} | "
            f"{f['pil_samples_per_cpu_s']:.0f} | {f['torchvision_samples_per_cpu_s']:.0f} |"
        )
    kinds = [kind for kind, f in results["floor"].items() if "stages_ms" in f]
    if kinds:
        lines += [
            "",
            "Per-sample CPU time by stage, ms (one process, one thread, the bytes in memory):",
            "",
            "| stage | " + " | ".join(kinds) + " |",
            "|---|" + "---|" * len(kinds),
        ]
        stages = {kind: results["floor"][kind]["stages_ms"] for kind in kinds}
        for key, label in STAGES:
            lines.append(f"| {label} | " + " | ".join(f"{stages[k][key]:.2f}" for k in kinds) + " |")
        for who in ("openclip", "ours"):
            totals = [sum(v for key, v in stages[k].items() if key.startswith(who)) for k in kinds]
            lines.append(f"| **{who}, all stages** | " + " | ".join(f"**{t:.2f}**" for t in totals) + " |")
    buffers = results["shuffle_buffer"]
    lines += [
        "",
        f"Shuffle buffers: ours {buffers['ours']}; OpenCLIP {buffers['openclip']}. "
        f"OpenCLIP patched: {results['openclip_patched']}.",
    ]
    return "\n".join(lines)


def _batch(summary: dict[str, Any]) -> str:
    return f"{summary['image_dtype']}, {summary['batch_bytes'] / 2**20:.1f} MiB"


def _versions() -> dict[str, str]:
    import open_clip
    import webdataset

    return {
        "torch": torch.__version__,
        "webdataset": webdataset.__version__,
        "open_clip": open_clip.__version__,
    }
