"""Collectives used by the losses, behind one small object so tests can run without a process group.

This and the engine are the only places that touch ``torch.distributed``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn


class Gatherer:
    """All-gathers along dim 0 across ``world_size`` ranks (a no-op for one rank)."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size

    @classmethod
    def from_process_group(cls) -> Gatherer:
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``tensor``, without autograd (no gradient is sent back)."""
        if self.world_size == 1:
            return tensor.detach()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.detach().contiguous())
        return torch.cat(parts)

    def gather_with_grad(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` keeping autograd: the backward sums gradients across ranks.

        Used only by the OpenCLIP baseline (``--gather-with-grad``); it sends O(B·d) gradients back.
        """
        if self.world_size == 1:
            return tensor
        return torch.cat(dist_fn.all_gather(tensor.contiguous()))
