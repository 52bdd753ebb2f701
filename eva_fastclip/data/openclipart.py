"""Real image-text pairs from Debian's ``openclipart-png``: the drawings and the names their artists gave.

``apt-get install openclipart-png`` puts about 6,900 clip-art drawings (Open Clip Art Library 0.18, public
domain) under ``/usr/share/openclipart/png/<category>/<subcategory>/.../<name>.png``. The package has no
metadata file: a drawing's title (often followed by its artist's name, cut to about 24 characters) is its
file name, and the library's curators filed it under a category path. A caption is both, cleaned up::

    food/fruit/apple_bitten_dan_gerhard_01.png  ->  "apple bitten dan gerhard, food, fruit"

(underscores and hyphens become spaces, camelCase is split, the trailing version number ``_01`` goes,
everything is lower case). Nothing else is added. Debian links a drawing filed under several categories
(or an identical copy under another name) to one file: each file is used once, under its own path.

Fixed split, from a hash of each file's path (the same on every machine, whatever the file system order):

- **zero-shot**: for each top-level category with at least ``min_class_size`` drawings filed nowhere
  else (``unsorted`` and ``special`` are not subjects and never classes), ``zeroshot_per_class`` of them;
  the class name is the category ("food", "signs and symbols"), the prompt is the class name alone, as
  it appears in the captions. Balanced, so chance is 1 / classes.
- **retrieval** (``val``): ``num_retrieval`` of the rest whose caption no other drawing has, so each
  caption names exactly one image.
- **train**: everything else, written in hash order (shards mix categories; the file system order would
  give shards of one category each).

Layout, as the toy data's (:mod:`eva_fastclip.data.toy`)::

    train/shard-*.tar + manifest.json    indices 0 .. n_train-1
    val/shard-*.tar + manifest.json      indices n_train .. n_train+n_val-1
    zeroshot/test/0.tar                  {key}.png + {key}.cls (+ {key}.json: source file, caption)
    zeroshot/test/nshards.txt            clip_benchmark's webdataset layout
    zeroshot/classnames.txt, zeroshot/zeroshot_classification_templates.txt
    dataset.json                         counts, classes, settings, package version (written last)

Images are composited onto white (most drawings are transparent), padded to a square and shrunk to
``image_size`` pixels once, here, so training decodes small PNGs.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import multiprocessing
import os
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, NamedTuple

from PIL import Image

from .shards import sample_key, shard_name, write_manifest, write_shard

log = logging.getLogger(__name__)

DEFAULT_ROOT = Path("/usr/share/openclipart/png")
PACKAGE = "openclipart-png"
INSTALL_HINT = f"apt-get install {PACKAGE}"
#: top-level folders that name no subject: never zero-shot classes (their drawings still train)
NOT_CLASSES = frozenset({"unsorted", "special"})
TEMPLATES = ["{c}"]
SUMMARY_NAME = "dataset.json"
#: larger drawings are left out (2 in 0.18: 21k x 30k pixels, 5 GB to decode). The package is trusted, so
#: this replaces PIL's decompression-bomb limit, which refuses a 16k x 14k drawing already
MAX_PIXELS = 2**28
FORMAT_VERSION = 1


class Drawing(NamedTuple):
    path: str
    """Relative to the package root, with "/" separators."""
    caption: str
    category: str
    """Top-level folder."""
    filed_elsewhere: bool
    """Linked from another top-level folder too: its class would be ambiguous."""


def clean_words(name: str) -> str:
    """A file or folder name as words: version suffix off, camelCase split, separators to spaces, lower."""
    name = re.sub(r"_\d\d[a-z]?$", "", name)
    name = re.sub(r"([a-z])([A-Z])", r"\1 \2", name)
    name = re.sub(r"[_\-\s]+", " ", name)
    return name.strip().lower()


def make_caption(relative_path: str) -> str:
    """``food/fruit/apple_bitten_dan_gerhard_01.png`` -> ``apple bitten dan gerhard, food, fruit``."""
    *folders, file_name = relative_path.split("/")
    words = [clean_words(Path(file_name).stem)] + [clean_words(folder) for folder in folders]
    return ", ".join(word for word in words if word)


def class_name(category: str) -> str:
    return clean_words(category)


def stable_order(path: str) -> str:
    """Sort key that shuffles paths the same way everywhere."""
    return hashlib.sha1(path.encode("utf-8")).hexdigest()


def check_installed(root: str | os.PathLike = DEFAULT_ROOT) -> Path:
    root = Path(root)
    if not root.is_dir() or not any(root.glob("*/*.png")):
        raise FileNotFoundError(
            f"no openclipart drawings under {root}: install them with `{INSTALL_HINT}` "
            "(Debian/Ubuntu; run `apt-get update` first if apt does not find it), or pass the folder "
            "that holds the category folders (animals/, food/, ...)"
        )
    return root


def package_version(root: Path) -> str:
    """The Debian package version from its changelog, or "unknown" (a copied folder has none)."""
    if len(root.parents) < 2:
        return "unknown"
    try:  # /usr/share/openclipart/png -> /usr/share/doc/openclipart-png/
        with gzip.open(root.parents[1] / "doc" / PACKAGE / "changelog.Debian.gz", "rt") as stream:
            match = re.match(r"\S+ \(([^)]+)\)", stream.readline())
    except OSError:
        return "unknown"
    return match.group(1) if match else "unknown"


def scan_drawings(root: str | os.PathLike = DEFAULT_ROOT) -> list[Drawing]:
    """Every PNG file under ``root`` once (symbolic links only mark further categories), sorted by path."""
    root = check_installed(root).resolve()
    files: dict[Path, str] = {}
    links: dict[Path, set[str]] = defaultdict(set)
    for folder, _, names in os.walk(root):
        for name in names:
            if not name.lower().endswith(".png"):
                continue
            path = Path(folder) / name
            relative = path.relative_to(root).as_posix()
            if path.is_symlink():
                target = path.resolve()
                if target.is_file() and target.is_relative_to(root):
                    links[target].add(relative.split("/")[0])
            elif "/" in relative:  # a file directly under root has no category
                files[path] = relative
    drawings = []
    for path, relative in files.items():
        category = relative.split("/")[0]
        drawings.append(
            Drawing(relative, make_caption(relative), category, bool(links.get(path, set()) - {category}))
        )
    return sorted(drawings, key=lambda d: d.path)


class Split(NamedTuple):
    train: list[Drawing]
    val: list[Drawing]
    zeroshot: list[tuple[Drawing, int]]
    """(drawing, label)."""
    classnames: list[str]


def split_drawings(
    drawings: list[Drawing], *, zeroshot_per_class: int, min_class_size: int, num_retrieval: int
) -> Split:
    """The fixed split described in the module docstring; raises if the drawings cannot fill it."""
    ordered = sorted(drawings, key=lambda d: stable_order(d.path))
    candidates: dict[str, list[Drawing]] = defaultdict(list)
    for drawing in ordered:
        if drawing.category not in NOT_CLASSES and not drawing.filed_elsewhere:
            candidates[drawing.category].append(drawing)
    categories = sorted(c for c, members in candidates.items() if len(members) >= min_class_size)
    if len(categories) < 2:
        raise ValueError(
            f"only {len(categories)} categories have >= {min_class_size} drawings: lower min_class_size"
        )
    if zeroshot_per_class >= min_class_size:
        raise ValueError(
            f"zeroshot_per_class={zeroshot_per_class} must be below min_class_size={min_class_size}, "
            "so every class keeps drawings to train on"
        )
    zeroshot = [
        (drawing, label)
        for label, category in enumerate(categories)
        for drawing in candidates[category][:zeroshot_per_class]
    ]
    held = {drawing.path for drawing, _ in zeroshot}
    caption_counts = Counter(d.caption for d in drawings)
    rest = [d for d in ordered if d.path not in held]
    val = [d for d in rest if caption_counts[d.caption] == 1][:num_retrieval]
    if len(val) < num_retrieval:
        raise ValueError(f"only {len(val)} drawings with a unique caption for num_retrieval={num_retrieval}")
    held |= {d.path for d in val}
    train = [d for d in rest if d.path not in held]
    return Split(train, val, zeroshot, [class_name(c) for c in categories])


def render(path: str | os.PathLike, image_size: int) -> bytes:
    """The drawing on white, padded to a square, shrunk to ``image_size`` pixels, as PNG bytes."""
    Image.MAX_IMAGE_PIXELS = None  # checked below, against MAX_PIXELS
    with Image.open(path) as image:
        if image.width * image.height > MAX_PIXELS:
            raise ValueError(f"{image.width}x{image.height} pixels, more than the {MAX_PIXELS} decoded here")
        # premultiplied alpha, so shrinking does not bleed the colour of transparent pixels into edges
        image = image.convert("RGBA").convert("RGBa")
    factor = max(1, min(image.size) // (4 * image_size))  # a cheap box reduction first: some are 16k wide
    image = image.reduce(factor).convert("RGBA")
    canvas = Image.new("RGBA", image.size, (255, 255, 255, 255))
    canvas.alpha_composite(image)
    side = max(canvas.size)
    square = Image.new("RGB", (side, side), (255, 255, 255))
    square.paste(canvas.convert("RGB"), ((side - canvas.width) // 2, (side - canvas.height) // 2))
    square = square.resize((image_size, image_size), Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    square.save(buffer, format="PNG")
    return buffer.getvalue()


def _render_job(job: tuple[str, int]) -> bytes | str:
    try:
        return render(*job)
    except Exception as err:  # one broken file is reported and left out, not a reason to stop
        return f"{type(err).__name__}: {err}"


def write_openclipart_dataset(
    out_dir: str | os.PathLike,
    *,
    root: str | os.PathLike = DEFAULT_ROOT,
    image_size: int = 32,
    zeroshot_per_class: int = 30,
    min_class_size: int = 60,
    num_retrieval: int = 500,
    samples_per_shard: int = 500,
    processes: int | None = None,
) -> dict[str, Any]:
    """Convert the installed drawings into train / val / zeroshot folders under ``out_dir``.

    Returns the summary also written to ``out_dir/dataset.json``. Deterministic: the same package and
    settings give the same files.
    """
    if min(image_size, zeroshot_per_class, num_retrieval, samples_per_shard) < 1:
        raise ValueError("image_size, zeroshot_per_class, num_retrieval and samples_per_shard must be >= 1")
    root = check_installed(root)
    drawings = scan_drawings(root)
    images, left_out = _render_all(root, drawings, image_size, processes or len(os.sched_getaffinity(0)))
    split = split_drawings(
        [d for d in drawings if d.path in images],
        zeroshot_per_class=zeroshot_per_class,
        min_class_size=min_class_size,
        num_retrieval=num_retrieval,
    )

    out_dir = Path(out_dir)
    (out_dir / SUMMARY_NAME).unlink(missing_ok=True)  # a half-rewritten folder must not look complete
    first = 0
    for name, members in (("train", split.train), ("val", split.val)):
        _write_pairs(out_dir / name, members, images, first, samples_per_shard)
        first += len(members)
    _write_zeroshot(out_dir / "zeroshot", split, images)
    summary = {
        "format": "eva_fastclip-openclipart",
        "version": FORMAT_VERSION,
        "source": str(root),
        "package": f"{PACKAGE} {package_version(root)}",
        "image_size": image_size,
        "zeroshot_per_class": zeroshot_per_class,
        "min_class_size": min_class_size,
        "num_retrieval": num_retrieval,
        "drawings": len(drawings),
        "left_out": left_out,
        "num_train": len(split.train),
        "num_val": len(split.val),
        "num_zeroshot": len(split.zeroshot),
        "classnames": split.classnames,
        "templates": TEMPLATES,
        "train_categories": dict(sorted(Counter(d.category for d in split.train).items())),
    }
    tmp = out_dir / (SUMMARY_NAME + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    os.replace(tmp, out_dir / SUMMARY_NAME)
    return summary


def read_summary(out_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The ``dataset.json`` of a complete conversion, or None."""
    path = Path(out_dir) / SUMMARY_NAME
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def _write_pairs(
    split_dir: Path, members: list[Drawing], images: dict[str, bytes], first: int, per_shard: int
) -> dict[str, Any]:
    split_dir.mkdir(parents=True, exist_ok=True)
    for stale in split_dir.glob("shard-*.tar"):
        stale.unlink()
    shards, counts = [], []
    for start in range(0, len(members), per_shard):
        samples = []
        for offset, drawing in enumerate(members[start : start + per_shard]):
            index = first + start + offset
            key = sample_key(index)
            meta = {"index": index, "key": key, "caption": drawing.caption, "source": drawing.path}
            image = images[drawing.path]
            samples.append({"__key__": key, "png": image, "txt": drawing.caption, "json": meta})
        shards.append(shard_name(len(shards)))
        counts.append(write_shard(split_dir / shards[-1], samples))
    return write_manifest(
        split_dir,
        shards=shards,
        samples_per_shard=counts,
        index_min=first,
        index_max=first + len(members) - 1,
    )


def _render_all(
    root: Path, drawings: list[Drawing], image_size: int, processes: int
) -> tuple[dict[str, bytes], list[str]]:
    """Every drawing rendered (:func:`render`) by its path, and the paths of those that failed (logged)."""
    jobs = [(str(root / d.path), image_size) for d in drawings]
    if processes > 1:
        with multiprocessing.Pool(processes) as pool:
            rendered = pool.map(_render_job, jobs, chunksize=64)
    else:
        rendered = [_render_job(job) for job in jobs]
    images, left_out = {}, []
    for drawing, result in zip(drawings, rendered):
        if isinstance(result, bytes):
            images[drawing.path] = result
        else:
            left_out.append(drawing.path)
            log.warning("openclipart: leaving out %s: %s", drawing.path, result)
    return images, left_out


def _write_zeroshot(zeroshot_dir: Path, split: Split, images: dict[str, bytes]) -> None:
    """The zero-shot set in clip_benchmark's layout: one shard of (image, class) pairs, class names,
    prompt templates."""
    (zeroshot_dir / "test").mkdir(parents=True, exist_ok=True)
    write_shard(
        zeroshot_dir / "test" / "0.tar",
        (
            {
                "__key__": f"s{i:07d}",
                "png": images[drawing.path],
                "cls": str(label),
                "json": {"source": drawing.path, "caption": drawing.caption},
            }
            for i, (drawing, label) in enumerate(split.zeroshot)
        ),
    )
    (zeroshot_dir / "test" / "nshards.txt").write_text("1\n")  # clip_benchmark refuses a folder without it
    (zeroshot_dir / "classnames.txt").write_text("\n".join(split.classnames) + "\n")
    (zeroshot_dir / "zeroshot_classification_templates.txt").write_text("\n".join(TEMPLATES) + "\n")
