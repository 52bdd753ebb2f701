"""Tar shards read into undecoded samples, and the skips of samples that cannot train.

A shard's members are grouped by key as webdataset groups them, except that a key names one sample (a
repeat is skipped and counted). Samples are numbered as kept, so every reader of a shard numbers them
alike and a reader of part of it (``first`` to ``stop``) reads past the rest without decoding it.
"""

from __future__ import annotations

import io
import logging
import re
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import PIL.Image
from torch import Tensor
from webdataset.tariterators import base_plus_ext

from .remote import Retries, ShardUnreachable
from .shard_io import command_failure, open_shard

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
    "unreadable_shard",  # a shard without a count that cannot be opened or read at all: once per attempt
    "unread",  # samples a shard's record counts that were not there: after a read error, or an early end
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
        self.skip_many(bad, 1)

    def skip_many(self, bad: BadSample, samples: int) -> None:
        """Count ``samples`` skipped for one cause, logged as one line (among the first few)."""
        if self.muted:
            return
        self.counts[SKIP_REASONS.index(bad.reason)] += samples
        self.warn(f"skipping {'a sample' if samples == 1 else f'{samples} samples'} ({bad.reason}): {bad}")
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
    url: str,
    failures: FailureLog,
    first: int = 0,
    stop: int | None = None,
    count: int | None = None,
    retries: Retries | None = None,
) -> Iterator[dict[str, Any]]:
    """One shard's undecoded samples numbered ``first`` up to ``stop`` (None: its end), its problems counted
    in ``failures``: its members grouped by key as webdataset groups them, except that a key names one
    sample. A later group under a key seen before in the shard (right after it or further on) is skipped
    and counted and the first kept, where webdataset drops the repeat member by member, or merges the two.

    A read error ends the shard and every sample before it is kept: a sample cut after some of its members
    is passed on and judged like any other; one cut at its first member is counted as incomplete; and every
    later one of this reader's numbers, up to ``stop`` or the shard's ``count`` (its record's), is counted
    as unread, with one line naming the shard, the numbers and the error. Without either the number lost
    is unknown, and the line says so. A shard that ends, with no error, before its ``count`` (a copy cut
    at a member's boundary reads as a whole tar) has the samples it lacks counted as unread too. All of it
    is counted before the sample ahead of the end is passed on (a consumer may stop at it).

    Samples are numbered as kept, so every reader of the shard numbers them alike; those before
    ``first`` are read past (their bytes, never decoded), and a problem is counted only by the reader
    whose numbers it falls among, so a shard split between consumers counts each skip once."""
    seen: set[str] = set()
    group: dict[str, Any] | None = None
    kept = 0  # samples kept so far: the number of the next one
    repeats = 0  # samples under a key seen before: in a record's count, not numbered
    error, cut = None, None
    for key, extension, data in tar_members(url, retries):
        new = key is not None and (group is None or group["__key__"] != key or extension in group)
        if isinstance(data, Exception):
            error, cut = data, key if new else None
            break  # the last item: the shard's stream is broken
        if new:
            judge = failures if _ours(kept, first, stop) else None
            if group is not None and _first_of_key(group, seen, judge):
                if kept >= first:
                    yield group
                kept += 1
                if stop is not None and kept >= stop:
                    return
            elif group is not None:
                repeats += 1
            group = {"__key__": key, "__url__": url}
        group[extension] = data
    judge = failures if _ours(kept, first, stop) else None
    last = group is not None and _first_of_key(group, seen, judge)
    read = _Read(url, first, stop, count, repeats + (group is not None and not last))
    if error is not None:
        read.count_the_rest(failures, error, cut, kept + last)
    elif count is not None:
        read.count_the_shortfall(failures, kept + last)
    elif group is None and first == 0:
        failures.note_empty_shard(url)
    if last and kept >= first:
        yield group


def _ours(number: int, first: int, stop: int | None) -> bool:
    return first <= number and (stop is None or number < stop)


@dataclass(frozen=True)
class _Read:
    """One reader's part of a shard: the sample numbers [first, stop), of ``count`` (its record's)."""

    url: str
    first: int
    stop: int | None
    count: int | None
    repeats: int  # samples of the shard under a key seen before: in its count, not numbered

    def count_the_rest(self, failures: FailureLog, error: Exception, cut: str | None, ahead: int) -> None:
        """Count what a read error at sample number ``ahead`` leaves undelivered of this reader's numbers:
        the sample ``cut`` at its first member (its key; None where the error fell between samples or
        inside the one before), then every later one, up to ``stop`` or ``count``."""
        url, first, stop = self.url, self.first, self.stop
        if cut is not None:
            if _ours(ahead, first, stop):
                message = f"shard {url}, sample {ahead} ({cut!r}): cut short at its first member ({error!r})"
                failures.skip(BadSample("incomplete", url, message))
            ahead += 1
        end = self._end()
        if end is None:  # nothing says how many samples the shard holds
            if ahead == 0 and first == 0:  # not one member could be read
                failures.skip(BadSample("unreadable_shard", url, f"{url}: {error!r}"))
            elif ahead >= first:
                failures.warn(
                    f"{url}: unreadable from sample {ahead} on ({error!r}); how many samples are lost is "
                    "unknown: no record (manifest.json, sizes.json, *_stats.json) counts this shard's samples"
                )
            return
        self._unread(failures, range(max(ahead, first), end), f"after a read error ({error!r})")

    def count_the_shortfall(self, failures: FailureLog, ahead: int) -> None:
        """Count the samples of this reader's numbers that a shard ending cleanly at ``ahead`` lacks."""
        end = self._end()
        why = f"the shard ended after {ahead + self.repeats} of the {self.count} samples its record counts"
        self._unread(failures, range(max(ahead, self.first), end if end is not None else 0), why)

    def _end(self) -> int | None:
        """Where this reader's numbers end: ``stop``, else the shard's count less its repeats."""
        if self.stop is not None:
            return self.stop
        return None if self.count is None else self.count - self.repeats

    def _unread(self, failures: FailureLog, lost: range, why: str) -> None:
        if lost:
            message = f"{self.url}: samples {lost.start} to {lost.stop - 1} unread: {why}"
            failures.skip_many(BadSample("unread", self.url, message), len(lost))


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


Member = tuple[str | None, str, bytes | Exception]


def tar_members(url: str, retries: Retries | None = None) -> Iterator[Member]:
    """(key, extension, bytes) of every file in the tar shard at ``url``, named as webdataset names them
    (the key is the path up to the file name's first dot; the extension is lower-cased). A read error ends
    it with (key, extension, error) if a member's data failed, else (None, "", error); a ``pipe:``
    command that failed is the error, where its output's early end made one, or where the tar ended
    cleanly at its end. A remote shard whose retries are spent raises ShardUnreachable: the run stops."""
    key, extension, stream = None, "", None
    try:
        with open_shard(url, retries) as stream, tarfile.open(fileobj=stream, mode="r|*") as tar:
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
        if (failed := command_failure(stream)) is not None:
            yield None, "", failed
    except ShardUnreachable:
        raise
    except Exception as exn:  # missing, not a tar, cut short, a failing pipe: command
        yield key, extension, command_failure(stream) or exn


def decode_image(data: bytes) -> PIL.Image.Image:
    """The image fully decoded, as RGB (as webdataset's "pil" decoder gives it)."""
    with io.BytesIO(data) as stream:
        image = PIL.Image.open(stream)
        image.load()
        return image.convert("RGB")
