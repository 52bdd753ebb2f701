"""Write image-text pairs as webdataset tar shards with a manifest, and read manifests back.

Shards use the img2dataset layout: ``{key}.{jpg,png,webp}``, ``{key}.txt`` (caption) and ``{key}.json``
(at least ``index``, ``key`` and ``caption``). ``index`` is the sample's stable dataset index and ``key``
the same number zero-padded, as img2dataset writes it: the loaders read it (``data.index_key``) to
address per-sample state, so it must never change when shards are rewritten.

Every shard folder carries a ``manifest.json``::

    {"format": "eva_fastclip-shards", "version": 1, "num_samples": N, "index_min": i0, "index_max": i1,
     "index_key": "key", "shards": ["shard-000000.tar", ...], "samples_per_shard": [...], "skipped": K}
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import PIL.Image
import webdataset as wds

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "eva_fastclip-shards"
MANIFEST_VERSION = 1

# File suffix -> extension stored in the shard; the loaders decode exactly these.
IMAGE_EXTENSIONS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}


def shard_name(shard_number: int) -> str:
    return f"shard-{shard_number:06d}.tar"


def sample_key(index: int) -> str:
    # Digits only: webdataset splits a member name at its first dot into key and extension.
    return f"{index:09d}"


def write_shard(path: str | os.PathLike, samples: Iterable[dict[str, Any]]) -> int:
    """Write ``samples`` (dicts: ``__key__`` and extension -> bytes/str/dict) to one tar; returns the count.

    The tar is written under a temporary name and renamed when complete, so a reader never sees half a
    shard. A fixed mtime makes identical samples give identical bytes.
    """
    path = Path(path)
    tmp_path = path.with_name(path.name + ".tmp")
    count = 0
    try:
        with wds.TarWriter(str(tmp_path), encoder=False, mtime=0) as writer:
            for sample in samples:
                writer.write(
                    {name: _to_bytes(value) if name != "__key__" else value for name, value in sample.items()}
                )
                count += 1
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    os.replace(tmp_path, path)
    return count


def _to_bytes(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False).encode("utf-8")
    return value


def write_manifest(
    out_dir: str | os.PathLike,
    *,
    shards: Sequence[str],
    samples_per_shard: Sequence[int],
    index_min: int | None,
    index_max: int | None,
    skipped: int = 0,
    index_key: str = "key",
) -> dict[str, Any]:
    """Write ``out_dir/manifest.json`` atomically (temp file + rename) and return its content."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "num_samples": int(sum(samples_per_shard)),
        "index_min": index_min,
        "index_max": index_max,
        "index_key": index_key,
        "shards": list(shards),
        "samples_per_shard": [int(n) for n in samples_per_shard],
        "skipped": int(skipped),
    }
    path = Path(out_dir) / MANIFEST_NAME
    tmp_path = path.with_name(path.name + ".tmp")
    tmp_path.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp_path, path)
    return manifest


def read_manifest(path_or_dir: str | os.PathLike) -> dict[str, Any] | None:
    """Our manifest at ``path_or_dir`` (a manifest.json or the folder holding one).

    None if there is none, or if the file is another tool's (not JSON, or no ``"format":
    "eva_fastclip-shards"``): a folder of downloaded shards may hold any tool's manifest.json, and it
    must not stop a run that lists the shards itself. ValueError if it is ours but incomplete.
    """
    path = Path(path_or_dir)
    if path.is_dir():
        path = path / MANIFEST_NAME
    if not path.is_file():
        return None
    return parse_manifest(path.read_bytes(), str(path))


def parse_manifest(text: bytes | str, where: str) -> dict[str, Any] | None:
    """:func:`read_manifest` of a manifest's text, read from ``where`` (a path or a URL)."""
    try:
        manifest = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None
    missing = [key for key in ("shards", "samples_per_shard", "index_max") if key not in manifest]
    if missing:
        raise ValueError(f"{where}: manifest lacks {missing}")
    if len(manifest["shards"]) != len(manifest["samples_per_shard"]):
        raise ValueError(f"{where}: 'shards' and 'samples_per_shard' have different lengths")
    return manifest


@dataclass(frozen=True)
class CaptionRow:
    row: int
    """0-based record number in the captions file: the sample's index is start_index + row."""
    line: int
    """1-based line in the captions file, for messages."""
    image: str
    caption: str


# The (image, caption) column pairs found without flags, in order of preference. Our own image/caption
# comes first so that a file make-shards read before keeps giving the same shards when it also has
# OpenCLIP's columns; filepath/title is open_clip_train's default (--csv-img-key/--csv-caption-key).
CONVENTIONS = (("image", "caption"), ("filepath", "title"))
_FLAGS = "--csv-img-key and --csv-caption-key"
_FOUND_WITHOUT_FLAGS = "OpenCLIP's filepath/title and image/caption are found without flags"


def read_captions(
    captions_file: str | os.PathLike,
    image_column: str | None = None,
    caption_column: str | None = None,
    separator: str | None = None,
) -> list[CaptionRow]:
    """All rows of a CSV/TSV (with header) or JSONL captions file; ValueError naming file and line if bad.

    A column left None is found in the header (or the first JSON record) by ``CONVENTIONS``; one that is
    named must be there. ``separator`` None is read off the CSV header: a tab there means tab-separated, a
    comma comma-separated, neither (one column) tab for a ``.tsv`` name, else comma. ``"\\t"`` as two
    characters is a tab.
    """
    path = Path(captions_file)
    if path.suffix.lower() in (".jsonl", ".json"):
        return list(_read_jsonl(path, image_column, caption_column))
    return list(_read_csv(path, image_column, caption_column, separator))


def csv_separator(value: str) -> str:
    """``value`` as the one-character delimiter csv takes; ``\\t`` as a shell passes it means a tab."""
    separator = "\t" if value == "\\t" else value
    if len(separator) != 1:
        raise ValueError(f"--csv-separator must be one character (or \\t for a tab), got {value!r}")
    return separator


def _detect_separator(path: Path, header_line: str) -> str:
    # the header, not the name, decides first: OpenCLIP's tab-separated files are often named .csv
    if "\t" in header_line:
        return "\t"
    if "," in header_line:
        return ","
    return "\t" if path.suffix.lower() == ".tsv" else ","


def _show(columns: Iterable[str]) -> str:
    # repr without quotes: a tab or newline inside a name must not break the one-line message
    return ", ".join(repr(column)[1:-1] for column in columns) or "no columns"


def _pick_columns(
    where: str, columns: Sequence[str], image_column: str | None, caption_column: str | None, what: str
) -> tuple[str, str]:
    """The (image, caption) columns to read: those named, else the first of ``CONVENTIONS`` present.

    ``where`` starts the message ("captions.csv"); ``what`` says what ``columns`` are ("its header").
    """
    for column, flag in ((image_column, "--csv-img-key"), (caption_column, "--csv-caption-key")):
        if column is not None and column not in columns:
            raise ValueError(
                f"{where}: no column {column!r} (named with {flag}): {what} has {_show(columns)}"
            )
    candidates = [
        (image_column or image, caption_column or caption)
        for image, caption in CONVENTIONS
        if (image_column or image) in columns and (caption_column or caption) in columns
    ]
    if not candidates:
        raise ValueError(
            f"{where}: no image/caption columns: {what} has {_show(columns)}; "
            f"name them with {_FLAGS} ({_FOUND_WITHOUT_FLAGS})"
        )
    if len(set(candidates)) > 1:
        chosen, other = candidates[0], candidates[1]
        logger.warning(
            "%s: %s has both %s/%s and %s/%s; reading %s/%s", where, what, *chosen, *other, *chosen
        )
    return candidates[0]


def _read_csv(
    path: Path, image_column: str | None, caption_column: str | None, separator: str | None
) -> Iterator[CaptionRow]:
    with path.open(newline="", encoding="utf-8-sig") as stream:
        header_line = stream.readline()
        delimiter = _detect_separator(path, header_line) if separator is None else csv_separator(separator)
        # the header line is read once: detection looks at it, then the reader parses it
        reader = csv.DictReader(itertools.chain([header_line], stream), delimiter=delimiter)
        try:
            header = reader.fieldnames or []
            separated = {"\t": "tab", ",": "comma"}.get(delimiter, repr(delimiter)) + "-separated"
            image_column, caption_column = _pick_columns(
                str(path), header, image_column, caption_column, f"its header ({separated})"
            )
            logger.info("%s: %s, columns %r/%r", path, separated, image_column, caption_column)
            for row_number, record in enumerate(reader):
                # DictReader fills missing trailing fields with None.
                image, caption = record[image_column], record[caption_column]
                if image is None or caption is None:
                    raise ValueError(
                        f"{path}, line {reader.line_num}: too few fields for "
                        f"{image_column!r}/{caption_column!r}"
                    )
                yield CaptionRow(row_number, reader.line_num, image, caption)
        except csv.Error as exc:
            raise ValueError(f"{path}, line {reader.line_num}: {exc}") from exc


def _read_jsonl(path: Path, image_column: str | None, caption_column: str | None) -> Iterator[CaptionRow]:
    with path.open(encoding="utf-8-sig") as stream:
        row_number = 0
        for line_number, line in enumerate(stream, start=1):
            if not line.strip():
                continue  # blank lines are not records and take no index
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}, line {line_number}: invalid JSON ({exc.msg})") from exc
            if not isinstance(record, dict):
                raise ValueError(
                    f"{path}, line {line_number}: expected a JSON object, got {type(record).__name__}"
                )
            if row_number == 0:  # the first record decides the keys, as a CSV's header does
                image_column, caption_column = _pick_columns(
                    f"{path}, line {line_number}",
                    list(record),
                    image_column,
                    caption_column,
                    "its first record",
                )
            for column in (image_column, caption_column):
                if not isinstance(record.get(column), str):
                    raise ValueError(f"{path}, line {line_number}: missing or non-string key {column!r}")
            yield CaptionRow(row_number, line_number, record[image_column], record[caption_column])
            row_number += 1


def _load_image_bytes(path: Path, verify: bool) -> tuple[bytes, str]:
    """The file's bytes and the extension to store them under; raises if unusable."""
    extension = IMAGE_EXTENSIONS.get(path.suffix.lower())
    if extension is None:
        raise ValueError(f"unsupported image type {path.suffix!r} (supported: {sorted(IMAGE_EXTENSIONS)})")
    data = path.read_bytes()
    if verify:
        with PIL.Image.open(io.BytesIO(data)) as image:
            image.load()  # a full decode: Image.verify() misses truncated files
    return data, extension


def write_shards(
    image_dir: str | os.PathLike,
    captions_file: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    samples_per_shard: int = 10000,
    start_index: int = 0,
    image_column: str | None = None,
    caption_column: str | None = None,
    separator: str | None = None,
    verify_images: bool = True,
) -> dict[str, Any]:
    """Pack images and captions into ``out_dir/shard-*.tar`` plus ``manifest.json``; returns the manifest.

    The captions file is read by ``read_captions``: columns and CSV separator not given are found in it.

    A sample's index is ``start_index`` + its row in the captions file, so re-running gives the same
    indices and a skipped row leaves a gap. Rows whose image is missing or (with ``verify_images``) does
    not decode are skipped, logged and counted in ``manifest["skipped"]``.
    """
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    # validates the whole file before anything is written
    rows = read_captions(captions_file, image_column, caption_column, separator)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    shards: list[str] = []
    counts: list[int] = []
    indices: list[int] = []
    skipped = 0
    pending: list[dict[str, Any]] = []

    def flush() -> None:
        shards.append(shard_name(len(shards)))
        counts.append(write_shard(out_dir / shards[-1], pending))
        pending.clear()

    for row in rows:
        index = start_index + row.row
        try:
            data, extension = _load_image_bytes(Path(image_dir) / row.image, verify_images)
        except Exception as exc:  # a bad image is a data problem to report, not a reason to stop
            skipped += 1
            logger.warning("%s, line %d: skipping %s: %s", captions_file, row.line, row.image, exc)
            continue
        key = sample_key(index)
        meta = {"index": index, "key": key, "caption": row.caption, "image_path": row.image}
        pending.append({"__key__": key, extension: data, "txt": row.caption, "json": meta})
        indices.append(index)
        if len(pending) == samples_per_shard:
            flush()
    if pending:
        flush()

    if skipped:
        logger.warning("%s: skipped %d of %d rows", captions_file, skipped, len(rows))
    return write_manifest(
        out_dir,
        shards=shards,
        samples_per_shard=counts,
        index_min=min(indices) if indices else None,
        index_max=max(indices) if indices else None,
        skipped=skipped,
    )
