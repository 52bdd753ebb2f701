"""Shard URLs from the config's sources: brace patterns, "::"-joined lists and folders, local or remote.

A remote source (any fsspec URL: data/remote.py) expands as a local one does: a folder to the shards its
manifest.json lists, else its ``*.tar``; every shard named must exist, checked with one listing per
folder (not one request per shard), so a missing one stops the run before step 1."""

from __future__ import annotations

import concurrent.futures
import functools
import glob
import logging
import os
from collections.abc import Sequence

import braceexpand

from .remote import Retries, is_remote, list_names, url_fs
from .shards import MANIFEST_NAME, read_manifest
from .sizes import RecordFolder

logger = logging.getLogger(__name__)


def expand_urls(patterns: str | Sequence[str]) -> list[str]:
    """Shard URLs from brace patterns ("dir/shard-{000000..000007}.tar"), "::"-joined lists and folders.

    A folder expands to the shards its manifest.json lists (or, without one of ours, its ``*.tar`` files).
    Local paths must exist: a typo fails here with FileNotFoundError, not later inside a loader worker.
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    urls: list[str] = []
    for pattern in patterns:
        for part in pattern.split("::"):
            if part.strip():
                urls.extend(_expand_pattern(part.strip()))
    return urls


def _expand_pattern(pattern: str) -> list[str]:
    if pattern.startswith("pipe:"):  # a command's output: nothing to look at before it runs
        return list(braceexpand.braceexpand(pattern))
    if is_remote(pattern):
        return _expand_remote(pattern)
    if os.path.isdir(pattern):
        return _shards_in_folder(pattern)
    urls = list(braceexpand.braceexpand(pattern))
    _require_files(urls, f"shard pattern {pattern!r}")
    return urls


def _shards_in_folder(folder: str) -> list[str]:
    manifest = read_manifest(folder)
    if manifest is not None:
        urls = [os.path.join(folder, name) for name in manifest["shards"]]
        _require_files(urls, f"{os.path.join(folder, MANIFEST_NAME)}")
    else:
        if os.path.isfile(os.path.join(folder, MANIFEST_NAME)):
            logger.info(
                "%s: its %s is another tool's, not eva_fastclip's: reading the folder's *.tar files",
                folder,
                MANIFEST_NAME,
            )
        urls = sorted(glob.glob(os.path.join(glob.escape(folder), "*.tar")))
    if not urls:
        raise FileNotFoundError(
            f"{folder}: no shards (neither a manifest.json listing shards nor *.tar files)"
        )
    return urls


def _require_files(paths: list[str], origin: str) -> None:
    _raise_missing([path for path in paths if not os.path.isfile(path)], paths, origin)


def _expand_remote(pattern: str) -> list[str]:
    urls = list(braceexpand.braceexpand(pattern))
    if len(urls) == 1 and not urls[0].endswith(".tar"):
        fs, path = url_fs(urls[0])
        if fs.isdir(path):
            return _remote_folder(urls[0].rstrip("/"))
    _require_remote(urls, f"shard pattern {pattern!r}")
    return urls


def _remote_folder(folder: str) -> list[str]:
    """The shards of a remote folder: those its manifest lists, else its *.tar (the listing and the
    manifest read as the records are: data/sizes.py)."""
    records = RecordFolder(folder)
    if records.manifest is not None:
        shards = records.manifest["shards"]
        urls = [records.where(name) for name in shards]
        missing = [records.where(name) for name in shards if name not in records.names]
        _raise_missing(missing, urls, records.where(MANIFEST_NAME))
        return urls
    urls = [records.where(name) for name in records.tar_names]
    if not urls:
        raise FileNotFoundError(
            f"{folder}: no shards (neither a manifest.json listing shards nor *.tar files)"
        )
    return urls


def _require_remote(urls: list[str], origin: str) -> None:
    """Every URL names an existing object: one listing of each folder they lie in (HTTP has no listing
    every server gives, nor names without a query: a request each)."""
    if urls and urls[0].split("://", 1)[0] in ("http", "https"):
        # every shard by rank 0, the first and last by the others (a request each, on every rank and
        # each call, would be millions at LAION's scale); once per process
        wanted = urls if os.environ.get("RANK", "0") == "0" else [urls[0], urls[-1]]
        wanted = [url for url in dict.fromkeys(wanted) if url not in _FOUND_OVER_HTTP]
        fs, _ = url_fs(urls[0])
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            found = list(pool.map(functools.partial(_exists, fs), wanted))
        _FOUND_OVER_HTTP.update(url for url, there in zip(wanted, found) if there)
        _raise_missing([url for url, there in zip(wanted, found) if not there], urls, origin)
        return
    by_folder: dict[str, list[str]] = {}
    for url in urls:
        by_folder.setdefault(url.rsplit("/", 1)[0], []).append(url)
    missing = []
    for folder, inside in by_folder.items():
        try:
            names = list_names(folder, Retries())
        except FileNotFoundError:
            names = set()
        missing += [url for url in inside if url.rsplit("/", 1)[1] not in names]
    _raise_missing(missing, urls, origin)


_FOUND_OVER_HTTP: set[str] = set()  # the HTTP shards this process saw exist


def _exists(fs, url: str) -> bool:
    """Whether the server has ``url`` (a 404), its failures retried (data/remote.py)."""
    try:
        Retries().call(url, fs.info, url)
    except FileNotFoundError:
        return False
    return True


def _raise_missing(missing: list[str], urls: list[str], origin: str) -> None:
    if missing:
        raise FileNotFoundError(
            f"{origin}: {len(missing)} of {len(urls)} shards do not exist (first: {missing[0]})"
        )
