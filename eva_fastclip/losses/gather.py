"""Collectives used by the losses, behind one small object so tests can run without a process group.

Apart from the engine (and the tools on top of it, export and bench) this is the only place that touches
``torch.distributed``. Every collective adds the bytes this rank contributes to ``traffic`` (by purpose), so
the traffic formula in docs/losses.md is testable.
"""

from __future__ import annotations

import warnings
from collections import Counter

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

# gather_with_grad's all-gather is deprecated for torch's private functional collectives; open_clip's
# ClipLoss, which the baseline reproduces, gathers with it, and it works: keep the runs' logs clean (a
# filter set once: catch_warnings per call would reset every once-per-location warning of the step)
warnings.filterwarnings("ignore", "torch.distributed.nn.functional.all_gather is deprecated", FutureWarning)


class Gatherer:
    """All-gathers along dim 0 and all-reduces across ``world_size`` ranks (no-ops for one rank)."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size
        self.traffic: Counter[str] = Counter()
        self.last: str | None = None  # the purpose of the last collective entered (a hang's report names it)

    @classmethod
    def from_process_group(cls) -> Gatherer:
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def _count(self, purpose: str, tensor: torch.Tensor) -> None:
        self.last = purpose
        if self.world_size > 1:
            self.traffic[purpose] += tensor.numel() * tensor.element_size()

    def gather(self, tensor: torch.Tensor, purpose: str = "gather") -> torch.Tensor:
        """Concatenate every rank's ``tensor``, without autograd (no gradient is sent back)."""
        if self.world_size == 1:
            return tensor.detach()
        self._count(purpose, tensor)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.detach().contiguous())
        return torch.cat(parts)

    def all_reduce_sum(self, tensor: torch.Tensor, purpose: str = "all_reduce") -> torch.Tensor:
        """Elementwise sum over ranks (returns a new tensor; no autograd)."""
        out = tensor.detach().clone()
        if self.world_size > 1:
            self._count(purpose, out)
            dist.all_reduce(out)
        return out

    def gather_with_grad(self, tensor: torch.Tensor, purpose: str = "gather_with_grad") -> torch.Tensor:
        """Concatenate every rank's ``tensor`` keeping autograd: the backward sums gradients across ranks.

        Used only by the OpenCLIP baseline (``--gather-with-grad``); its backward sends the B·d gradient
        of the gathered tensor, counted under ``purpose + "_backward"``.
        """
        if self.world_size == 1:
            return tensor
        self._count(purpose, tensor)
        out = torch.cat(dist_fn.all_gather(tensor.contiguous()))
        if out.requires_grad:
            out.register_hook(lambda grad: self._count(purpose + "_backward", grad))
        return out
