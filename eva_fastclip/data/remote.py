"""Shards and their records where the data lives: any fsspec URL (``s3://``, ``gs://``, ``https://``, ...).

A remote shard is read front to back in chunks, each one range request (``fs.cat_file(path, start,
end)``). A request that fails (a connection cut mid-transfer, a 5xx, a stall past the client's read
timeout) or that returns fewer bytes than it asked for is made again after a wait that doubles
(:class:`Retries`), from the first byte not yet handed to the reader: no byte of the shard, hence no
sample, is lost or read twice. Each retry is logged with the shard and the byte. When the retries are
spent the read raises :class:`ShardUnreachable`, naming the shard, the byte and the last error: the
training loop stops every rank, saves, and exits with it (engine/step_batches.py).

Credentials and endpoints come from each library's own environment (``AWS_ENDPOINT_URL``,
``AWS_PROFILE``, ``GOOGLE_APPLICATION_CREDENTIALS``, ...), never from our config files. s3fs reads S3
and its clones (R2, MinIO); gcsfs (the ``remote`` extra) reads GCS; fsspec itself reads HTTP(S).
"""

from __future__ import annotations

import io
import logging
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

#: bytes a range request asks for: large enough that a request's cost is small against its transfer
CHUNK_BYTES = 8 << 20


def is_remote(url: str) -> bool:
    """An fsspec URL other than a local file (``s3://``, ``gs://``, ``https://``, ...)."""
    return "://" in url and not url.startswith("file://")


def url_fs(url: str, retried_here: bool = False) -> tuple[Any, str]:
    """The fsspec file system that reads ``url``, and the path it knows it by. ``retried_here`` (a
    shard's reads): s3fs and botocore are told not to retry themselves, in an instance of its own, since
    :class:`Retries` does, with a line for each (theirs are silent); the user's own settings
    (``FSSPEC_S3``: timeouts, endpoint) are kept. Everything else keeps the libraries' retries."""
    import fsspec

    protocol = url.split("://", 1)[0]
    options: dict[str, Any] = {}
    if retried_here and protocol in ("s3", "s3a"):
        configured = fsspec.config.conf.get("s3", {})
        config_kwargs = {**configured.get("config_kwargs", {}), "retries": {"max_attempts": 1}}
        options = {"config_kwargs": config_kwargs}
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as err:  # e.g. gs:// without gcsfs
        raise ValueError(f"{url}: {err} (pip install 'eva_fastclip[remote]')") from None
    except ValueError as err:  # an unknown protocol
        raise ValueError(f"{url}: {err}") from None
    if options:
        fs.retries = 1  # s3fs's own attempts at a request (a class attribute, not an argument)
    return fs, path


class ShardUnreachable(OSError):
    """A shard whose bytes could not be read after every retry. Made from one message (a DataLoader
    worker's exception is rebuilt in the main process from its text)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)

    def __reduce__(self):
        return type(self), (str(self),)


_NOT_RETRIED = (FileNotFoundError, PermissionError, IsADirectoryError, NotImplementedError, TypeError)
_NOT_RETRIED_NAMES = {"NoCredentialsError", "PartialCredentialsError", "InvalidBucketName"}


def _transient(err: Exception) -> bool:
    """fsspec's HTTP client reports any failure of its size request (a timeout, a 5xx, a reset) as
    FileNotFoundError: only one caused by a 404 (or by nothing) is an object that is not there."""
    cause = err.__cause__
    return (
        isinstance(err, FileNotFoundError)
        and cause is not None
        and type(cause).__module__.startswith("aiohttp")
        and getattr(cause, "status", None) != 404
    )


@dataclass(frozen=True)
class Retries:
    """How a failed request is made again: ``tries`` more times, the first after ``wait_s``, each next
    wait twice the one before (data.read_retries, data.retry_wait_s)."""

    tries: int = 6
    wait_s: float = 1.0

    def call(self, what: str, request, *args):
        """``request(*args)``, made again on failure; ShardUnreachable naming ``what`` once spent."""
        for attempt in range(self.tries + 1):
            try:
                return request(*args)
            except Exception as err:  # noqa: BLE001 (every transport's own errors: retried alike)
                final = isinstance(err, _NOT_RETRIED) and not _transient(err)
                if final or type(err).__name__ in _NOT_RETRIED_NAMES:
                    raise  # no wait makes it right: no such object, no access, no credentials
                if attempt == self.tries:
                    raise ShardUnreachable(
                        f"{what}: {type(err).__name__}: {err} (after {self.tries} retries)"
                    ) from err
                wait = self.wait_s * 2**attempt
                logger.warning("%s: %s: %s; retry %d of %d in %.1f s", what, type(err).__name__, err,
                               attempt + 1, self.tries, wait)  # fmt: skip
                time.sleep(wait)
        raise AssertionError("unreachable")


class RemoteShard(io.RawIOBase):
    """A remote shard's bytes, read front to back in range requests, each retried (:class:`Retries`)."""

    def __init__(self, url: str, retries: Retries, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.url, self.retries, self.chunk_bytes = url, retries, chunk_bytes
        self.fs, self.path = url_fs(url, retried_here=True)
        self.size = int(self._call(f"{url}: its size", self._info)["size"])
        self.position = 0  # the first byte not yet handed to the reader
        self._chunk, self._used = b"", 0

    def _info(self) -> dict:
        self.fs.invalidate_cache(self.path)  # a listing cached before may be stale
        return self.fs.info(self.path)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self._used == len(self._chunk):
            if self.position >= self.size:
                return 0
            self._chunk, self._used = self._call(f"{self.url} at byte {self.position}", self._fetch), 0
        got = min(len(buffer), len(self._chunk) - self._used)
        buffer[:got] = self._chunk[self._used : self._used + got]
        self._used += got
        self.position += got
        return got

    def _call(self, what: str, request):
        """``request()`` with its retries; what is not retried (no access, no credentials, a shard gone
        since the run listed it) stops the run too: a shard's samples are not to be counted as lost for
        a cause that every shard after it would meet."""
        try:
            return self.retries.call(what, request)
        except ShardUnreachable:
            raise
        except Exception as err:  # noqa: BLE001 (every client's own errors)
            raise ShardUnreachable(f"{what}: {type(err).__name__}: {err} (not retried)") from err

    def _fetch(self) -> bytes:
        end = min(self.position + self.chunk_bytes, self.size)
        data = self.fs.cat_file(self.path, start=self.position, end=end)
        if len(data) != end - self.position:  # a transfer cut short that the client did not notice
            raise ConnectionError(f"{len(data)} of the {end - self.position} bytes asked for came")
        return data


def read_bytes(url: str, retries: Retries) -> bytes:
    """A small remote file whole (a record beside the shards); FileNotFoundError where there is none."""
    fs, path = url_fs(url)
    return retries.call(url, fs.cat_file, path)


def list_names(folder_url: str, retries: Retries, fresh: bool = False) -> set[str]:
    """The names of the files in a remote folder; FileNotFoundError if there is none. One listing a
    process (fsspec keeps it: the run's checks, records and loader look at its shards' folders in turn),
    or a new one where ``fresh`` (a folder this process writes to)."""
    fs, path = url_fs(folder_url)
    return names_in(fs, path, retries, fresh)


def names_in(fs, path: str, retries: Retries, fresh: bool = False) -> set[str]:
    """:func:`list_names` of ``path`` on ``fs``."""
    if fresh:
        fs.invalidate_cache(path)
    entries = retries.call(f"{path}: its listing", fs.ls, path, False)
    return {str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries}
