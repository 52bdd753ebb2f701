"""A split of a Hugging Face dataset as the ``datasets`` library left it in a local cache folder, read with
pyarrow alone: no network, no ``datasets`` install and no loading script.

DataComp's ``download_evalsets.py`` runs ``datasets.load_dataset("nlphuji/<name>", split="test",
cache_dir=<root>/hf_cache)`` (datasets 2.8.0, pinned in its requirements), which leaves:

- the prepared split: ``hf_cache/nlphuji___<name>/<config>/<version>/<hash>/<name>-test.arrow`` (one file;
  ``<name>-test-00000-of-0000N.arrow`` past 500 MB), an Arrow IPC *stream* whose schema metadata
  ("huggingface") holds the features, beside ``dataset_info.json``, written once the split is complete;
- the downloads: ``hf_cache/downloads/<sha256 of the URL>`` with a ``.json`` naming the URL, and each
  archive unpacked under ``hf_cache/downloads/extracted/<sha256>/``.

An ``Image()`` feature that a loading script yielded as a file path is stored as that absolute path (no
bytes), under ``downloads/extracted`` of the cache as it was at download time: it is looked up under this
cache first (the cache may have moved or been copied since: another machine, another mount), then where
it was (``remap_cached_path``). Sources: datasets 2.8.0 ``builder.py`` (``_relative_data_dir``, the file
names), ``arrow_writer.py`` (``RecordBatchStreamWriter``), ``features/image.py`` (``encode_example``),
``utils/file_utils.py`` (the download names and their ``.json``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: the part of a stored path from which it is found again under another cache folder: from an unpacked
#: archive's folder on (the old cache's own path may hold a "downloads" too), else from the last "downloads"
_EXTRACTED_PART = re.compile(r"(?:^|[/\\])(downloads[/\\]extracted[/\\][0-9a-f]{64}[/\\].*)$")
_CACHED_PART = re.compile(r".*(?:^|[/\\])(downloads[/\\].*)$")


def prepared_split(hf_cache: str | os.PathLike, repo: str, split: str = "test") -> list[Path] | None:
    """The Arrow file(s) of ``repo``'s ``split`` under ``hf_cache``, in shard order, or None when the split
    was never prepared there. With several prepared copies (another config, version or script hash), the
    complete ones (with ``dataset_info.json``) first, then the newest; an unfinished preparation's
    ``.incomplete`` folder never."""
    namespace, _, name = repo.rpartition("/")
    folder = Path(hf_cache) / (f"{namespace}___{name}" if namespace else name)
    # a preparation writes into "<hash>.incomplete" and renames it when done: one killed leaves it behind
    copies = [path for path in folder.glob("*/*/*") if path.is_dir() and path.suffix != ".incomplete"]
    pattern = re.compile(rf"{re.escape(name)}-{re.escape(split)}(-\d{{5}}-of-\d{{5}})?\.arrow")
    candidates = []
    for copy in copies:
        files = sorted(path for path in copy.iterdir() if pattern.fullmatch(path.name))
        if files:
            candidates.append(((copy / "dataset_info.json").is_file(), copy.stat().st_mtime, files))
    if not candidates:
        return None
    _, _, files = max(candidates, key=lambda candidate: candidate[:2])
    return files


def read_arrow_rows(files: list[Path]) -> Iterator[dict[str, Any]]:
    """The rows of Arrow IPC stream files (as the ``datasets`` library writes them) as plain dicts."""
    import pyarrow as pa

    for path in files:
        try:
            with pa.memory_map(str(path)) as source:
                reader = pa.ipc.open_stream(source)
                for batch in reader:
                    yield from batch.to_pylist()
        except pa.ArrowInvalid as err:
            raise ValueError(f"{path}: not an Arrow stream as the datasets library writes ({err})") from err


def cached_downloads(hf_cache: str | os.PathLike) -> dict[str, Path]:
    """The files the ``datasets`` library downloaded into ``hf_cache/downloads``, by their URL."""
    downloads = Path(hf_cache) / "downloads"
    found = {}
    for sidecar in sorted(downloads.glob("*.json")):
        try:
            url = json.loads(sidecar.read_text())["url"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not one of the library's sidecars
        file = sidecar.with_suffix("")
        if isinstance(url, str) and file.is_file():
            found[url] = file
    return found


def remap_cached_path(stored: str, hf_cache: str | os.PathLike) -> Path:
    """Where a path stored in a prepared split is now: its part from ``downloads/`` on, under ``hf_cache``
    (the cache may have moved or been copied since it was written), else the path as stored.
    FileNotFoundError naming both when neither exists."""
    match = _EXTRACTED_PART.search(stored) or _CACHED_PART.match(stored)
    here = Path(hf_cache) / match.group(1).replace("\\", "/") if match else None
    if here is not None and here.exists():
        return here
    if os.path.exists(stored):
        return Path(stored)
    under = f", nor under this cache as {here}" if here is not None else ""
    raise FileNotFoundError(f"{stored}: an image of the prepared split, not found{under}")
