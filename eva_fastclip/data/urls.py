"""Shard URLs from the config's sources: brace patterns, "::"-joined lists and folders."""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Sequence

import braceexpand

from .shards import MANIFEST_NAME, read_manifest
from .sizes import is_remote

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
    if is_remote(pattern):
        return list(braceexpand.braceexpand(pattern))
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
    missing = [path for path in paths if not os.path.isfile(path)]
    if missing:
        raise FileNotFoundError(
            f"{origin}: {len(missing)} of {len(paths)} shards do not exist (first: {missing[0]})"
        )
