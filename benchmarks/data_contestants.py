"""The loader benchmark's contestants: OpenCLIP's own webdataset loader (patched to run here, nothing else)
and ours, over the same shards, with the model's open_clip training transform and tokenizer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class _Missing(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        raise ImportError(
            f"{self.__name__} is not installed (benchmarks.data_loader imported open_clip_train without it)"
        )


def openclip_data() -> types.ModuleType:
    """``open_clip_train.data``; where pandas is missing, imported with a placeholder for it (only its CSV
    dataset, which this benchmark does not use, needs pandas)."""
    try:
        import open_clip_train.data as data
    except ModuleNotFoundError as exn:
        if exn.name != "pandas":
            raise
        sys.modules["pandas"] = _Missing("pandas")
        try:
            import open_clip_train.data as data
        finally:
            del sys.modules["pandas"]
    return data


@contextlib.contextmanager
def openclip_patched() -> Iterator[types.ModuleType]:
    """``open_clip_train.data`` with its ``group_by_keys_nothrow`` replaced by webdataset's
    ``group_by_keys`` while the context lasts (it raises KeyError 'fname' on webdataset 1.0's end-of-shard
    marker); the original is put back after."""
    from webdataset.tariterators import group_by_keys

    data = openclip_data()
    original = data.group_by_keys_nothrow
    data.group_by_keys_nothrow = group_by_keys
    try:
        yield data
    finally:
        data.group_by_keys_nothrow = original


def openclip_batches(
    urls: list[str],
    preprocess,
    tokenizer,
    batch_size: int,
    workers: int,
    seed: int,
    local: list[str] | None = None,
):
    """OpenCLIP's training loader (``get_wds_dataset``, as open_clip_train's ``get_data`` calls it for
    ``--dataset-type webdataset``) over ``urls``, and its batches per epoch; its --train-num-samples from
    the img2dataset records beside the ``local`` copies of remote ``urls``. Call it inside
    :func:`openclip_patched` and iterate it there: its workers start with the first iteration."""
    data = openclip_data()
    args = argparse.Namespace(
        train_data="::".join(urls),
        val_data=None,
        train_num_samples=sum(_stats_successes(url) for url in local or urls),  # its --train-num-samples
        dataset_resampled=False,
        train_data_upsampling_factors=None,
        batch_size=batch_size,
        workers=workers,
        world_size=1,
        seed=seed,
    )
    info = data.get_wds_dataset(args, preprocess, is_train=True, epoch=0, tokenizer=tokenizer)
    return info.dataloader, info.dataloader.num_batches


def our_batches(
    urls: list[str],
    preprocess,
    tokenizer,
    batch_size: int,
    workers: int,
    seed: int,
    shuffle_buffer: int = 1000,
    decode_device: str | None = None,
    pin_memory: bool = False,
):
    """Our training loader over ``urls`` (no per-sample state, so no index is needed), and its batches
    per epoch; with ``decode_device`` the workers hand over JPEG bytes (``data.image_decode=gpu``)."""
    from eva_fastclip.data import TrainLoader

    loader = TrainLoader(
        urls,
        preprocess=preprocess,
        tokenize=tokenizer,
        batch_size=batch_size,
        workers=workers,
        seed=seed,
        needs_index=False,
        shuffle_buffer=shuffle_buffer,
        decode_device=decode_device,
        pin_memory=pin_memory,
    )
    return loader, loader.num_batches


def _stats_successes(url: str) -> int:
    stats = Path(url).with_name(Path(url).name.replace(".tar", "_stats.json"))
    return int(json.loads(stats.read_text())["successes"])


def training_transform(model: str):
    """open_clip's training transform of ``model``, built from its config without building the model: a
    model created and freed in this process leaves a heap that the parent rewrites after the workers fork,
    and those pages would count as the workers' private memory."""
    import open_clip

    config = open_clip.get_model_config(model)
    if config is None:
        raise ValueError(f"--model {model!r} is not an open_clip architecture: see open_clip.list_models()")
    options = {
        k: v
        for k, v in config.get("preprocess_cfg", {}).items()
        if k in ("mean", "std", "interpolation", "resize_mode")
    }
    transform = open_clip.image_transform(config["vision_cfg"]["image_size"], is_train=True, **options)
    from eva_fastclip.data.image_transform import TrainImageTransform, explain_unrecognised

    if TrainImageTransform.from_preprocess(transform) is None:  # before any work, not after the runs
        raise ValueError(
            f"--model {model}: its training transform is not one ours takes apart: "
            f"{explain_unrecognised(transform)}"
        )
    return transform
