"""Tar shards read into undecoded samples, and the skips of samples that cannot train.

A shard's members are grouped by key as webdataset groups them, except that a key names one sample (a
repeat is skipped and counted). Samples are numbered as kept, so every reader of a shard numbers them
alike and a reader of part of it (``first`` to ``stop``) reads past the rest without decoding it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import tarfile
from collections.abc import Callable, Iterator
from typing import Any

import PIL.Image
import webdataset as wds
from torch import Tensor
from webdataset.tariterators import base_plus_ext

logger = logging.getLogger(__name__)

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
_WARNINGS_PER_PROCESS = 10
_META_MEMBER = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata files: not part of any sample

Preprocess = Callable[[PIL.Image.Image], Tensor]
Tokenize = Callable[[list[str]], Tensor]


def first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0].strip()


def parse_index(value: Any) -> int | None:
    """A dataset index from a .json field: an integer or a string of digits (img2dataset's "000010005",
    read as FastCLIP reads it, ``int(key)``); None for anything else."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63:
        return value
    return None


SKIP_REASONS = (
    "undecodable_image",  # PIL cannot decode it (corrupt, truncated, an unknown format)
    "empty_caption",  # no text on the caption's first line: nothing to contrast the image with
    "non_utf8_caption",  # .txt bytes that are not UTF-8 (OpenCLIP skips these too)
    "no_usable_index",  # only for a loss with per-sample state: .json or its index missing or out of range
    "duplicate_key",  # a key seen before in the same shard: the first sample under it is kept
    "incomplete",  # no image or no .txt member, e.g. the last sample of a shard cut short
    "unreadable_shard",  # a shard that cannot be opened or read at all: counted once per attempt
)
"""Why the training loader skips a sample; the counts are logged per reason (``train/data/skipped/*``)."""


class BadSample(ValueError):
    """A sample the training loader skips and counts under ``reason`` (one of SKIP_REASONS)."""

    def __init__(self, reason: str, url: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.url = reason, url

    def __reduce__(self):  # raised in loader workers: pickle rebuilds it from these, not from args
        return type(self), (self.reason, self.url, str(self))


class FailureLog:
    """Counts the skipped samples of this process's stream by reason and stops a stream that only fails.

    Every batch carries its worker's counts as they stood at its last sample (``TrainLoader._collate``),
    so the loader's totals cover exactly the samples its batches were drawn past, whatever the workers
    had read ahead. A long run of failures with no good sample in between (e.g. every image in a format
    PIL cannot decode) raises, naming the shards, instead of skipping forever.
    """

    def __init__(self, max_in_a_row: int) -> None:
        self.max_in_a_row = max_in_a_row
        self.start()

    def start(self) -> None:
        """A new stream of this process (a loader worker, or the main process without workers)."""
        self.counts = [0] * len(SKIP_REASONS)
        self._in_a_row = 0
        self._shards_in_a_row: dict[str, None] = {}  # the shards of the current run of failures, in order
        self._warned = 0
        # set while a resumed stream reads again what it had read before the save: the saved counts hold
        # its problems already
        self.muted = False

    def skip(self, bad: BadSample) -> None:
        """Count one skipped sample (or unreadable shard) and log the first few of this process."""
        if self.muted:
            return
        self.counts[SKIP_REASONS.index(bad.reason)] += 1
        self.warn(f"skipping a sample ({bad.reason}): {bad}")
        self._count_failure(bad.url, str(bad))

    def warn(self, message: str) -> None:
        if self._warned < _WARNINGS_PER_PROCESS and not self.muted:
            self._warned += 1
            logger.warning("%s", message[:500])

    def note_empty_shard(self, url: str) -> None:
        if not self.muted:
            self._count_failure(url, f"{url} holds no samples")

    def note_success(self) -> None:
        self._in_a_row = 0
        self._shards_in_a_row.clear()

    def _count_failure(self, url: str, what: str) -> None:
        self._in_a_row += 1
        self._shards_in_a_row[url] = None
        if self._in_a_row >= self.max_in_a_row:
            shards = list(self._shards_in_a_row)
            named = ", ".join(shards[:5]) + (f" and {len(shards) - 5} more" if len(shards) > 5 else "")
            raise RuntimeError(
                f"{self._in_a_row} samples in a row could not be read or used, none good in between, "
                f"from {len(shards)} shard(s): {named} (last: {what[:300]}). The data is missing or corrupt, "
                "in a format PIL cannot decode, or without usable indices (data.index_key, "
                "data.index_size)"
            )


def shard_samples(
    url: str, failures: FailureLog, first: int = 0, stop: int | None = None
) -> Iterator[dict[str, Any]]:
    """One shard's undecoded samples numbered ``first`` up to ``stop`` (None: its end), its problems counted
    in ``failures``: its members grouped by key as webdataset groups them, except that a key names one
    sample. A later group under a key seen before in the shard (right after it or further on) is skipped
    and counted and the first kept, where webdataset drops the repeat member by member, or merges the two.
    A read error ends the shard and every sample before it is kept: a sample cut after some of its members
    is passed on and judged like any other; one cut at its first member is counted as incomplete at once,
    before the sample ahead of it is passed on.

    Samples are numbered as kept, so every reader of the shard numbers them alike; those before
    ``first`` are read past (their bytes, never decoded), and a problem is counted only by the reader
    whose numbers it falls among, so a shard split between consumers counts each skip once."""
    seen: set[str] = set()
    group: dict[str, Any] | None = None
    failed = False
    kept = 0  # samples kept so far: the number of the next one

    def ours() -> bool:
        return first <= kept and (stop is None or kept < stop)

    for key, extension, data in tar_members(url):
        new = key is not None and (group is None or group["__key__"] != key or extension in group)
        if isinstance(data, Exception):
            failed = True
            if ours():
                failures.warn(f"{url}: unreadable from here on, the rest is lost: {data!r}")
                if new:
                    message = f"shard {url}, sample {key!r}: cut short at its first member ({data!r})"
                    failures.skip(BadSample("incomplete", url, message))
                elif group is None:  # not one member could be read
                    failures.skip(BadSample("unreadable_shard", url, f"{url}: {data!r}"))
            break  # the last item: the shard's stream is broken
        if new:
            if group is not None and _first_of_key(group, seen, failures if ours() else None):
                if kept >= first:
                    yield group
                kept += 1
                if stop is not None and kept >= stop:
                    return
            group = {"__key__": key, "__url__": url}
        group[extension] = data
    if group is not None:
        if _first_of_key(group, seen, failures if ours() else None) and kept >= first:
            yield group
    elif not failed and first == 0:
        failures.note_empty_shard(url)


def _first_of_key(group: dict[str, Any], seen: set[str], failures: FailureLog | None) -> bool:
    """Whether ``group`` is the first under its key in its shard; a repeat is counted as a skip in
    ``failures`` (None: by another reader)."""
    key = group["__key__"]
    if key in seen:
        if failures is not None:
            message = f"shard {group['__url__']}: key {key!r} again; the first sample under it is kept"
            failures.skip(BadSample("duplicate_key", group["__url__"], message))
        return False
    seen.add(key)
    return True


def tar_members(url: str) -> Iterator[tuple[str | None, str, bytes | Exception]]:
    """(key, extension, bytes) of every file in the tar shard at ``url``, named as webdataset names them
    (the key is the path up to the file name's first dot; the extension is lower-cased). A read error ends
    it with (key, extension, error) if a member's data failed, else (None, "", error)."""
    key, extension = None, ""
    try:
        with contextlib.closing(wds.gopen(url)) as stream, tarfile.open(fileobj=stream, mode="r|*") as tar:
            for member in tar:
                tar.members = []  # a stream keeps every header it read: drop them, as webdataset does
                if not member.isreg() or _META_MEMBER.match(member.name):
                    continue
                key, extension = base_plus_ext(member.name)
                if key is None:
                    continue
                extension = extension.lower()
                data = tar.extractfile(member).read()
                yield key, extension, data
                key, extension = None, ""
    except Exception as exn:  # missing, not a tar, cut short, a failing pipe: command
        yield key, extension, exn


def decode_image(data: bytes) -> PIL.Image.Image:
    """The image fully decoded, as RGB (as webdataset's "pil" decoder gives it)."""
    with io.BytesIO(data) as stream:
        image = PIL.Image.open(stream)
        image.load()
        return image.convert("RGB")
