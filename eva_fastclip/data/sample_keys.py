"""A sample's key: what seeds its random crop in the loader and picks its token mask in the model.

The key is a hash of (run seed, epoch, the sample, its occurrence in the epoch) and of nothing else: not the
rank, the loader worker, the micro-batch or the pass through the model. So 1 or K ranks, a resumed run and
both passes of a cached step (``train.contrastive_batch: global``) crop and mask a sample alike.
"""

from __future__ import annotations

import zlib

import torch


def sample_key(seed: int, epoch: int, sample: int | str, occurrence: int | str = 0) -> int:
    """The 32-bit key of ``sample`` (its dataset index, or a name where it has none) in ``epoch``."""
    return zlib.crc32(f"{seed}:{epoch}:{sample}:{occurrence}".encode())


def keys_for_indices(seed: int, epoch: int, indices: torch.Tensor) -> torch.Tensor:
    """int64 keys of samples by dataset index, each at its first occurrence in ``epoch``: the keys
    TrainLoader gives them, for a loader that hands no keys (benchmarks, tests)."""
    return torch.tensor([sample_key(seed, epoch, int(i)) for i in indices.tolist()], dtype=torch.int64)
