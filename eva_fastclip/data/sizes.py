"""The two sizes a run takes from its shards, kept apart as FastCLIP keeps them.

- ``num_samples``: samples per epoch, what the shards hold (``data.num_samples``).
- ``index_size``: rows of the per-sample state table, above every index a sample carries
  (``data.index_size``, FastCLIP's ``--data_size``). It exceeds ``num_samples`` wherever indices have
  gaps: img2dataset's keys skip every failed download (CC3M: 3,318,333 rows for 2,723,840 samples).

A number given in the config wins and nothing is read for it. Otherwise every shard's share comes from
the first record beside it that has one:

======================================  ============================  ====================================
record (writer)                         samples                       index bound
======================================  ============================  ====================================
``manifest.json`` (make-shards)         ``samples_per_shard``         ``index_max`` + 1
``sizes.json`` (OpenCLIP)               ``{shard name: count}``
``{shard}_stats.json`` (img2dataset)    ``successes``
``{shard}.parquet`` (img2dataset)                                     1 + the largest ``index_key`` value
``__len__`` (OpenCLIP)                  the folder's total, when
                                        all its ``*.tar`` are used
======================================  ============================  ====================================

img2dataset's key is ``shard_id * 10**k + row`` and its parquet holds every input row, failed downloads
included, so 1 + its largest key is never below a key any sample carries, and with shards of a power of
ten rows (the default) it is the number of input rows (CC3M: exactly FastCLIP's 3,318,333). A shard with
no record leaves its number unknown: then the config must give it.

Each record is read once per call, with a progress bar where there are many (LAION-400M: 41,408 parquet
files, minutes on shared storage). A run reads them once, on rank 0, and hands the resulting
``DataSizes`` (each shard's count included) to every rank's loader: data/ never talks to other ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .remote import Retries, is_remote, list_names, read_bytes, url_fs
from .shards import MANIFEST_NAME, parse_manifest

FROM_MANIFEST = MANIFEST_NAME
FROM_SIZES_JSON = "sizes.json"
FROM_LEN = "__len__"
FROM_STATS = "img2dataset *_stats.json"
FROM_PARQUET = "img2dataset *.parquet"


@dataclass(frozen=True)
class DataSizes:
    num_samples: int
    """Samples per epoch."""
    num_samples_from: str
    """Where it was read: "data.num_samples" or the records, e.g. "img2dataset *_stats.json"."""
    index_size: int | None
    """Rows of the per-sample table (every index lies in [0, index_size)); None when no loss needs it."""
    index_size_from: str | None
    """Where it was read: "data.index_size" or the records; None with index_size."""
    shard_counts: tuple[int, ...] | None = field(default=None, compare=False)
    """Samples of each shard, in the order of the URLs, where a record counts every one of them (our
    manifest, sizes.json, _stats.json); None otherwise. Lets an epoch be split at sample granularity. Left
    out of equality: two DataSizes are the same sizes from the same records, whatever the split."""


class _NoRecord(Exception):
    """A shard's number is not written anywhere beside it."""


def resolve_sizes(
    urls: Sequence[str],
    *,
    num_samples: int | None = None,
    index_size: int | None = None,
    needs_index: bool = True,
    index_key: str = "key",
) -> DataSizes:
    """Samples per epoch and per-sample table size of the shards ``urls``: the given ones, else read.

    ``index_size`` is only looked for when ``needs_index`` (a loss keeps per-sample state). ValueError
    naming the config key to set when a number is neither given nor recorded.
    """
    records = _Records(index_key)
    shard_counts = records.shard_counts(urls)
    num_from = "data.num_samples"
    if num_samples is None:
        try:
            num_samples, num_from = records.num_samples(urls)
        except _NoRecord as missing:
            raise ValueError(
                f"cannot tell how many samples the shards hold: {missing} (records read: our "
                "manifest.json, OpenCLIP's sizes.json or __len__, img2dataset's <shard>_stats.json); "
                "set data.num_samples"
            ) from None
    index_from: str | None = None
    if not needs_index:
        index_size = None
    elif index_size is not None:
        index_from = "data.index_size"
    else:
        try:
            index_size, index_from = records.index_size(urls)
        except _NoRecord as missing:
            raise ValueError(
                f"cannot tell how many rows the per-sample table needs: {missing} (records read: our "
                "manifest.json, img2dataset's <shard>.parquet); set data.index_size above every "
                "sample's index (FastCLIP's data_size)"
            ) from None
        if index_size < 1:
            raise ValueError(f"the records of the shards hold no index ({index_from}); set data.index_size")
    return DataSizes(num_samples, num_from, index_size, index_from, shard_counts)


def _split(url: str) -> tuple[str, str]:
    """A shard's folder and name (a local path or a remote URL)."""
    if is_remote(url):
        folder, _, name = url.rpartition("/")
        return folder, name
    path = Path(url)
    return str(path.parent), path.name


def _companion(shard_name: str, suffix: str) -> str:
    """img2dataset's companion file: 00012.tar -> 00012.parquet, 00012_stats.json."""
    return shard_name.removesuffix(".tar") + suffix


def has_records(url: str) -> bool:
    """Whether records can lie beside this shard: not a pipe: command's output."""
    return not url.startswith("pipe:")


def _count(value: Any, where: str) -> int:
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = -1
    if isinstance(value, (bool, float)) or count < 0:
        raise ValueError(f"{where}: {value!r} is not a sample count")
    return count


def _parse_json(text: bytes, where: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: not valid JSON ({exc})") from exc


class RecordFolder:
    """The records in one shard folder, local or remote (one listing of it), each read when first needed."""

    def __init__(self, folder: str) -> None:
        self.folder, self.remote = folder, is_remote(folder)

    def where(self, name: str) -> str:
        return f"{self.folder}/{name}" if self.remote else os.path.join(self.folder, name)

    @cached_property
    def names(self) -> set[str]:
        try:
            return list_names(self.folder, Retries()) if self.remote else set(os.listdir(self.folder))
        except (FileNotFoundError, NotADirectoryError):
            return set()

    def read(self, name: str) -> bytes | None:
        """The file ``name`` of the folder, or None where there is none."""
        if name not in self.names:
            return None
        if self.remote:
            return read_bytes(self.where(name), Retries())
        path = Path(self.where(name))
        return path.read_bytes() if path.is_file() else None

    @cached_property
    def manifest(self) -> dict[str, Any] | None:
        text = self.read(MANIFEST_NAME)  # None for another tool's manifest.json
        return None if text is None else parse_manifest(text, self.where(MANIFEST_NAME))

    @cached_property
    def manifest_counts(self) -> dict[str, int]:
        manifest = self.manifest or {"shards": [], "samples_per_shard": []}
        return dict(zip(manifest["shards"], manifest["samples_per_shard"]))

    @cached_property
    def sizes_json(self) -> dict[str, int]:
        text, where = self.read("sizes.json"), self.where("sizes.json")
        if text is None:
            return {}
        sizes = _parse_json(text, where)
        if not isinstance(sizes, dict):
            raise ValueError(f"{where}: expected an object {{shard name: sample count}}")
        return {name: _count(count, f"{where}, {name!r}") for name, count in sizes.items()}

    @cached_property
    def total(self) -> int | None:
        text = self.read("__len__")
        return None if text is None else _count(text.decode().strip(), self.where("__len__"))

    @cached_property
    def tar_names(self) -> list[str]:
        return sorted(name for name in self.names if name.endswith(".tar"))

    def parquet(self, name: str) -> Any:
        """What pyarrow opens for the parquet ``name``, as a context: a path, or a remote file (whole
        ranges read as pyarrow asks, no read-ahead), closed after."""
        if not self.remote:
            return contextlib.nullcontext(self.where(name))
        fs, path = url_fs(self.where(name))
        return fs.open(path, "rb", cache_type="none")


#: records to read beyond which the progress bar shows at once (else after 2 s)
_MANY_RECORDS = 1000


def _progress(items: Sequence[Any], what: str) -> Any:
    """``items``, with a progress bar on stderr where reading them takes a while."""
    return tqdm(items, desc=what, unit="shard", delay=0 if len(items) > _MANY_RECORDS else 2, leave=False)


class _Records:
    def __init__(self, index_key: str) -> None:
        self.index_key = index_key
        self._folders: dict[str, RecordFolder] = {}
        self._counts: dict[str, tuple[int, str] | None] = {}  # each shard's count, read once

    def _folder(self, url: str) -> tuple[RecordFolder, str]:
        """The folder a shard lies in, and its name there."""
        folder, name = _split(url)
        if folder not in self._folders:
            self._folders[folder] = RecordFolder(folder)
        return self._folders[folder], name

    def _shard_count(self, url: str) -> tuple[int, str] | None:
        if url not in self._counts:
            self._counts[url] = self._read_shard_count(url)
        return self._counts[url]

    def _read_shard_count(self, url: str) -> tuple[int, str] | None:
        folder, name = self._folder(url)
        if name in folder.manifest_counts:
            return folder.manifest_counts[name], FROM_MANIFEST
        if name in folder.sizes_json:
            return folder.sizes_json[name], FROM_SIZES_JSON
        stats = _companion(name, "_stats.json")
        text = folder.read(stats)
        if text is None:
            return None
        record = _parse_json(text, folder.where(stats))
        successes = record.get("successes") if isinstance(record, dict) else None
        return _count(successes, f"{folder.where(stats)}, 'successes'"), FROM_STATS

    def shard_counts(self, urls: Sequence[str]) -> tuple[int, ...] | None:
        """Each shard's count, where a record gives every one of them (else None)."""
        counts = []
        for url in _progress(urls, "counting the samples of each shard"):
            try:
                count = self._shard_count(url) if has_records(url) else None
            except ValueError:  # a malformed record: num_samples() names it where the count is needed
                count = None
            if count is None:
                return None
            counts.append(count[0])
        return tuple(counts)

    def num_samples(self, urls: Sequence[str]) -> tuple[int, str]:
        """Samples in ``urls`` (a shard listed twice counts twice) and the records they came from."""
        by_folder: dict[str, list[str]] = {}
        for url in urls:
            if not has_records(url):
                raise _NoRecord(f"{url} is a command's output")
            by_folder.setdefault(_split(url)[0], []).append(url)
        total, origins = 0, set()
        for folder_name, shards in by_folder.items():
            counts = [self._shard_count(shard) for shard in shards]
            folder = self._folders[folder_name]
            if all(count is not None for count in counts):
                total += sum(count for count, _ in counts)
                origins |= {origin for _, origin in counts}
            elif folder.total is not None and sorted(_split(s)[1] for s in shards) == folder.tar_names:
                total += folder.total
                origins.add(FROM_LEN)
            else:
                missing = shards[[count is None for count in counts].index(True)]
                raise _NoRecord(f"no record counts the samples of {missing}")
        return total, " + ".join(sorted(origins))

    def index_size(self, urls: Sequence[str]) -> tuple[int, str]:
        """1 + the largest index any shard of ``urls`` may hold, and the records that say so."""
        bound, origins = 0, set()
        for url in _progress(list(dict.fromkeys(urls)), "reading each shard's index bound"):
            if not has_records(url):
                raise _NoRecord(f"{url} is a command's output")
            folder, name = self._folder(url)
            if name in folder.manifest_counts:
                index_max = folder.manifest["index_max"]
                bound = max(bound, 0 if index_max is None else index_max + 1)
                origins.add(FROM_MANIFEST)
                continue
            parquet = _companion(name, ".parquet")
            if parquet not in folder.names:
                raise _NoRecord(f"no record bounds the indices of {url}")
            with folder.parquet(parquet) as source:
                bound = max(bound, _parquet_bound(source, folder.where(parquet), self.index_key))
            origins.add(FROM_PARQUET)
        return bound, " + ".join(sorted(origins))


def _parquet_bound(source: Any, path: str, column: str) -> int:
    """1 + the largest value of ``column`` over every row of an img2dataset parquet (0 if none)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(source)  # one column of one file: ~6x faster than pq.read_table
    if column not in parquet.schema_arrow.names:
        raise _NoRecord(f"{path} has no column {column!r} (data.index_key)")
    values = parquet.read(columns=[column]).column(column)
    try:
        largest = pc.max(pc.cast(values, pa.int64())).as_py()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise ValueError(f"{path}: column {column!r} holds values that are not integers ({exc})") from None
    return 0 if largest is None else largest + 1
