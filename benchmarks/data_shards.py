"""The loader benchmark's shards: real photographs, offline, in img2dataset's layout.

scikit-learn's two sample photos (640x427) cut into thousands of distinct JPEGs (seeded random crops of
10-100% of the area, random aspect 3/4-4/3 and position, flips, small colour and brightness changes), JPEG
quality 95, in img2dataset's layout (``00000.tar`` with ``<key>.jpg/.txt/.json``, ``00000_stats.json``).
Two kinds of the same crops: ``256px`` (shorter side 256, img2dataset's keep-ratio resize) and ``original``
(longer side 640-1024 px: the crops are upscaled, since the photos themselves are only 640 px wide).
Written once under the benchmark's ``--data`` and reused.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import PIL.ImageEnhance

from eva_fastclip.data.shards import write_shard

KINDS = ("256px", "original")
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
    write = "import json, sys\nfrom benchmarks.data_shards import _write_bench_shards as w\n"
    # benchmarks/ is found from the repository's root, whatever the folder this runs in
    path = os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    subprocess.run([sys.executable, "-c", write + "w(**json.loads(sys.argv[1]))", job], check=True, env=env)
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
