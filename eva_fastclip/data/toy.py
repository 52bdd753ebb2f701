"""The embedded toy dataset: coloured shapes drawn with PIL, captioned from templates, no download.

Every image shows 1-3 copies of one coloured shape (5 colours x 4 shapes = 20 classes) on a plain
background, so colour and shape stay obvious even at 32x32 and a tiny CLIP learns them in minutes on a CPU.
Each sample is drawn from its own RNG seeded by (seed, split, index): the output does not depend on how
the work is split into shards or processes.

Layout written by :func:`write_toy_dataset`::

    train/shard-*.tar + manifest.json    indices 0 .. num_train-1
    val/shard-*.tar + manifest.json      indices num_train .. num_train+num_val-1 (continuing train's, so
                                          an index names one sample across the whole toy dataset)
    zeroshot/test/0.tar                  clip_benchmark's webdataset layout: {key}.png + {key}.cls
    zeroshot/test/nshards.txt            (clip_benchmark refuses a folder without it)
    zeroshot/classnames.txt
    zeroshot/zeroshot_classification_templates.txt
"""

from __future__ import annotations

import io
import math
import multiprocessing
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from PIL import Image, ImageDraw

from .shards import sample_key, shard_name, write_manifest, write_shard

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 90, 230),
    "yellow": (240, 210, 30),
    "purple": (150, 60, 200),
}
SHAPES: dict[str, str] = {
    "circle": "circles",
    "square": "squares",
    "triangle": "triangles",
    "cross": "crosses",
}
BACKGROUNDS: dict[str, tuple[int, int]] = {"white": (215, 250), "grey": (105, 150), "black": (5, 40)}

TOY_CLASSNAMES: list[str] = [f"{color} {shape}" for color in COLORS for shape in SHAPES]
TOY_TEMPLATES: list[str] = [
    "a photo of a {c}.",
    "a picture of a {c}.",
    "a drawing of a {c}.",
    "an image of a {c}.",
    "a {c}.",
]

_COUNT_WORDS = {1: "a", 2: "two", 3: "three"}
# 3x3 grid cell (row, column) -> phrase, used when a single object makes "where" unambiguous.
_POSITIONS = {
    (0, 0): "in the top left",
    (0, 1): "at the top",
    (0, 2): "in the top right",
    (1, 0): "on the left",
    (1, 1): "in the center",
    (1, 2): "on the right",
    (2, 0): "in the bottom left",
    (2, 1): "at the bottom",
    (2, 2): "in the bottom right",
}
_SPLIT_IDS = {"train": 0, "val": 1, "zeroshot": 2}


def toy_classnames() -> list[str]:
    return list(TOY_CLASSNAMES)


def toy_templates() -> list[str]:
    return list(TOY_TEMPLATES)


def draw_scene(
    rng: np.random.Generator, image_size: int, label: int | None = None
) -> tuple[Image.Image, dict]:
    """One image and its labels; ``label`` forces the colour-shape class (else it is drawn at random)."""
    if label is None:
        label = int(rng.integers(len(TOY_CLASSNAMES)))
    color_name, shape = TOY_CLASSNAMES[label].split(" ")
    background = list(BACKGROUNDS)[int(rng.integers(len(BACKGROUNDS)))]
    shade = int(rng.integers(*BACKGROUNDS[background]))
    count = int(rng.integers(1, 4))

    image = Image.new("RGB", (image_size, image_size), (shade, shade, shade))
    draw = ImageDraw.Draw(image)
    # Jitter the colour a little so the model learns colour names, not one exact RGB value.
    fill = tuple(int(np.clip(c + rng.integers(-20, 21), 0, 255)) for c in COLORS[color_name])
    radius = image_size * float(rng.uniform(0.15, 0.24)) / (1.0 if count == 1 else 1.4)  # 3 must fit
    centers = _place(rng, count, radius, image_size)
    for cx, cy in centers:
        _draw_shape(draw, shape, cx, cy, radius, fill)

    labels = {
        "label": label,
        "color": color_name,
        "shape": shape,
        "count": count,
        "background": background,
        "position": _position_phrase(centers[0], image_size) if count == 1 else None,
    }
    return image, labels


def _place(rng: np.random.Generator, count: int, radius: float, size: int) -> list[tuple[float, float]]:
    # Rejection sampling keeps copies apart so the count stays visible; after many tries accept overlap.
    centers: list[tuple[float, float]] = []
    for _ in range(200):
        if len(centers) == count:
            break
        cx, cy = rng.uniform(radius + 1, size - radius - 1, size=2)
        if all(math.hypot(cx - x, cy - y) > 2.6 * radius + 2 for x, y in centers):  # squares need > 2r
            centers.append((float(cx), float(cy)))
    while len(centers) < count:
        centers.append(tuple(float(v) for v in rng.uniform(radius + 1, size - radius - 1, size=2)))
    return centers


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill: tuple) -> None:
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        side = r * 0.9  # same visual weight as the circle
        draw.rectangle((cx - side, cy - side, cx + side, cy + side), fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r * 0.8), (cx + r, cy + r * 0.8)], fill=fill)
    elif shape == "cross":
        arm = r * 0.35
        draw.rectangle((cx - r, cy - arm, cx + r, cy + arm), fill=fill)
        draw.rectangle((cx - arm, cy - r, cx + arm, cy + r), fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def _position_phrase(center: tuple[float, float], size: int) -> str:
    column, row = (min(2, int(3 * v / size)) for v in center)
    return _POSITIONS[(row, column)]


def make_caption(rng: np.random.Generator, labels: dict) -> str:
    """A caption that always names colour and shape, often count, position or background."""
    count = labels["count"]
    noun = labels["shape"] if count == 1 else SHAPES[labels["shape"]]
    phrase = f"{_COUNT_WORDS[count]} {labels['color']} {noun}"
    background = f"on a {labels['background']} background"
    where = labels["position"]
    templates = [
        phrase,
        f"a photo of {phrase}",
        f"a picture of {phrase} {background}",
        f"{phrase} {background}",
        f"there {'is' if count == 1 else 'are'} {phrase} {where or background}",
        f"{phrase} {where}" if where else f"an image with {phrase}",
    ]
    return templates[int(rng.integers(len(templates)))]


def _png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _sample_rng(seed: int, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, _SPLIT_IDS[split], index])


class _ShardJob(NamedTuple):
    path: str
    split: str
    first: int
    """Index of the shard's first sample; the shard holds indices [first, first + count)."""
    count: int
    image_size: int
    seed: int


def _write_pair_shard(job: _ShardJob) -> int:
    samples = []
    for index in range(job.first, job.first + job.count):
        rng = _sample_rng(job.seed, job.split, index)
        image, labels = draw_scene(rng, job.image_size)
        caption = make_caption(rng, labels)
        key = sample_key(index)
        meta = {"index": index, "key": key, "caption": caption, **labels}
        samples.append({"__key__": key, "png": _png_bytes(image), "txt": caption, "json": meta})
    return write_shard(job.path, samples)


def _write_zeroshot_shard(job: _ShardJob) -> int:
    # Classes are balanced: sample i shows class i mod 20.
    samples = []
    for index in range(job.first, job.first + job.count):
        label = index % len(TOY_CLASSNAMES)
        image, _ = draw_scene(_sample_rng(job.seed, job.split, index), job.image_size, label=label)
        samples.append({"__key__": f"s{index:07d}", "png": _png_bytes(image), "cls": str(label)})
    return write_shard(job.path, samples)


def _run_job(job: _ShardJob) -> int:
    return _write_zeroshot_shard(job) if job.split == "zeroshot" else _write_pair_shard(job)


def _pair_jobs(
    out_dir: Path, split: str, first: int, total: int, per_shard: int, image_size: int, seed: int
) -> list[_ShardJob]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        _ShardJob(
            str(out_dir / shard_name(n)),
            split,
            start,
            min(per_shard, first + total - start),
            image_size,
            seed,
        )
        for n, start in enumerate(range(first, first + total, per_shard))
    ]


def write_toy_dataset(
    out_dir: str | os.PathLike,
    *,
    num_train: int = 8192,
    num_val: int = 512,
    num_zeroshot: int = 800,
    image_size: int = 64,
    samples_per_shard: int = 1024,
    seed: int = 0,
) -> dict[str, Any]:
    """Write the toy train/val/zeroshot folders under ``out_dir``; returns ``{"train": manifest, ...}``.

    Deterministic for a given seed. Shards are drawn in parallel over the available CPU cores.
    """
    if min(num_train, num_val, num_zeroshot, image_size, samples_per_shard) < 1:
        raise ValueError("num_train, num_val, num_zeroshot, image_size and samples_per_shard must be >= 1")
    out_dir = Path(out_dir)
    train_jobs = _pair_jobs(out_dir / "train", "train", 0, num_train, samples_per_shard, image_size, seed)
    val_jobs = _pair_jobs(out_dir / "val", "val", num_train, num_val, samples_per_shard, image_size, seed)
    zeroshot_dir = out_dir / "zeroshot"
    (zeroshot_dir / "test").mkdir(parents=True, exist_ok=True)
    zeroshot_job = _ShardJob(
        str(zeroshot_dir / "test" / "0.tar"), "zeroshot", 0, num_zeroshot, image_size, seed
    )

    # Biggest jobs first so the pool's last stragglers are small.
    jobs = sorted([*train_jobs, *val_jobs, zeroshot_job], key=lambda job: -job.count)
    processes = min(len(jobs), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    if processes > 1:
        with multiprocessing.Pool(processes) as pool:
            pool.map(_run_job, jobs, chunksize=1)
    else:
        for job in jobs:
            _run_job(job)

    (zeroshot_dir / "test" / "nshards.txt").write_text("1\n")  # the one shard, test/0.tar
    (zeroshot_dir / "classnames.txt").write_text("\n".join(TOY_CLASSNAMES) + "\n")
    (zeroshot_dir / "zeroshot_classification_templates.txt").write_text("\n".join(TOY_TEMPLATES) + "\n")
    return {
        "train": _write_split_manifest(out_dir / "train", train_jobs),
        "val": _write_split_manifest(out_dir / "val", val_jobs),
        "zeroshot": {
            "num_samples": num_zeroshot,
            "num_classes": len(TOY_CLASSNAMES),
            "shards": ["test/0.tar"],
        },
    }


def _write_split_manifest(split_dir: Path, jobs: list[_ShardJob]) -> dict[str, Any]:
    return write_manifest(
        split_dir,
        shards=[Path(job.path).name for job in jobs],
        samples_per_shard=[job.count for job in jobs],
        index_min=jobs[0].first,
        index_max=jobs[-1].first + jobs[-1].count - 1,
    )
