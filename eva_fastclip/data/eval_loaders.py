"""The ordered evaluation loaders: retrieval pairs and clip_benchmark-layout classification sets, each
sample once, unshuffled."""

from __future__ import annotations

import functools
import glob
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import webdataset as wds
from torch import Tensor
from torch.utils.data import DataLoader

from .tar_reader import IMAGE_KEYS, Preprocess, Tokenize, first_line
from .urls import expand_urls

logger = logging.getLogger(__name__)

_IMAGE_FIELD = ";".join(IMAGE_KEYS)  # webdataset's "first of these keys" syntax
#: how a zero-shot prompt template marks the class name: clip_benchmark's "{c}", or "{}"
TEMPLATE_PLACEHOLDERS = ("{c}", "{}")


def _warn_and_skip(exn: Exception) -> bool:
    logger.warning("evaluation: skipping unreadable sample: %s", repr(exn)[:500])
    return True


def _ordered_pipeline(urls: list[str], *stages: Any) -> wds.DataPipeline:
    """Shards in the given order, split between loader workers, decoded to PIL; every sample once."""
    return wds.DataPipeline(
        wds.SimpleShardList(urls),
        wds.split_by_worker,
        wds.tarfile_to_samples(handler=_warn_and_skip),
        wds.decode("pil", handler=_warn_and_skip),
        *stages,
    )


def _collate_image_text(tokenize: Tokenize, examples: list[tuple[Tensor, str]]) -> tuple[Tensor, Tensor]:
    images, captions = zip(*examples)
    return torch.stack(images), tokenize(list(captions))


def _collate_image_label(examples: list[tuple[Tensor, int]]) -> tuple[Tensor, Tensor]:
    images, labels = zip(*examples)
    return torch.stack(images), torch.tensor(labels, dtype=torch.int64)


def build_retrieval_loader(
    sources: str | Sequence[str],
    *,
    preprocess: Preprocess,
    tokenize: Tokenize,
    batch_size: int,
    workers: int = 0,
) -> Iterable[tuple[Tensor, Tensor]]:
    """``(images, tokens)`` batches of image-text pairs, each sample once, unshuffled (in shard order when
    ``workers`` is 0); the caption is the first line of the sample's .txt."""
    pipeline = _ordered_pipeline(
        expand_urls(sources),
        wds.to_tuple(_IMAGE_FIELD, "txt"),
        wds.map_tuple(preprocess, first_line),
        wds.batched(batch_size, collation_fn=functools.partial(_collate_image_text, tokenize), partial=True),
    )
    return DataLoader(pipeline, batch_size=None, num_workers=workers)


def _check_label(num_classes: int, label: int) -> int:
    if not 0 <= label < num_classes:
        raise ValueError(
            f"class label {label} outside [0, {num_classes}): classnames.txt does not match the shards"
        )
    return label


def _read_lines(path: Path) -> list[str]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (clip_benchmark layout expected)")
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line]


def read_classification_folder(dataset_dir: str | os.PathLike) -> tuple[list[str], list[str], list[str]]:
    """The shards, class names and prompt templates of a clip_benchmark-layout classification folder.

    Reads the names of ``dataset_dir/test/*.tar``, ``classnames.txt`` (one class per line) and
    ``zeroshot_classification_templates.txt`` (one template per line). A template marks the class name
    with "{c}", as clip_benchmark's files do, or "{}" (clip_benchmark's builder rewrites such prompts to
    "{c}"; ``evaluation.fill_template`` fills either). FileNotFoundError or ValueError naming the file.
    """
    root = Path(dataset_dir)
    if not root.is_dir():
        raise FileNotFoundError(
            f"{root}: no such folder (clip_benchmark layout expected: test/*.tar, classnames.txt, "
            "zeroshot_classification_templates.txt)"
        )
    shards = sorted(glob.glob(os.path.join(glob.escape(str(root / "test")), "*.tar")))
    if not shards:
        raise FileNotFoundError(f"{root / 'test'}: no *.tar shards (clip_benchmark layout expected)")
    classnames = _read_lines(root / "classnames.txt")
    if not classnames:
        raise ValueError(f"{root / 'classnames.txt'} names no class")
    templates = _read_lines(root / "zeroshot_classification_templates.txt")
    bad = [template for template in templates if not any(p in template for p in TEMPLATE_PLACEHOLDERS)]
    if bad or not templates:
        raise ValueError(
            f"{root / 'zeroshot_classification_templates.txt'}: every line needs a {{c}} or {{}} placeholder "
            "for the class name" + (f" ({bad[0]!r} has none)" if bad else " (the file has no line)")
        )
    return shards, classnames, templates


def build_classification_loader(
    dataset_dir: str | os.PathLike,
    *,
    preprocess: Preprocess,
    batch_size: int,
    workers: int = 0,
) -> tuple[Iterable[tuple[Tensor, Tensor]], list[str], list[str]]:
    """A clip_benchmark-layout classification set: ``(loader of (images, labels), classnames, templates)``.

    Reads ``dataset_dir/test/*.tar`` ({key}.jpg/png/webp + {key}.cls), ``classnames.txt`` and
    ``zeroshot_classification_templates.txt`` (:func:`read_classification_folder`).
    """
    shards, classnames, templates = read_classification_folder(dataset_dir)
    pipeline = _ordered_pipeline(
        shards,
        wds.to_tuple(_IMAGE_FIELD, "cls"),
        wds.map_tuple(preprocess, functools.partial(_check_label, len(classnames))),
        wds.batched(batch_size, collation_fn=_collate_image_label, partial=True),
    )
    return DataLoader(pipeline, batch_size=None, num_workers=workers), classnames, templates
