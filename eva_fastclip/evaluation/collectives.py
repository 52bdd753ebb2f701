"""How the ranks share an evaluation without knowing the engine: one collective, and two rules that keep
it from deadlocking.

Evaluation receives an object with ``rank``, ``world_size`` and ``gather(tensor)`` (every rank's equally
shaped tensor, concatenated along dim 0): the engine passes its ``losses.Gatherer``, a single process
:class:`SingleRank`, tests a fake. Every rank calls the same collectives in the same order, whatever its
share of the work:

- :func:`run_everywhere` ends each rank's local work with one gather of an "it failed" flag, so an error
  on one rank (an unreadable folder, a bad sample) raises on every rank instead of leaving the others
  waiting in the next collective;
- :func:`gather_rows` sends each rank's row count and shape first, so ranks with more, fewer or no rows
  (an empty share) take part in the same calls, and the padding never reaches the result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")
_MAX_DIMS = 3  # rows of at most 2 trailing dimensions: features [n, d], metadata [n, m], ordinals [n]


class Collectives(Protocol):
    rank: int
    world_size: int

    def gather(self, tensor: Tensor) -> Tensor:
        """Every rank's ``tensor`` (the same shape on every rank), concatenated along dim 0 in rank order."""
        ...


class SingleRank:
    """The collectives of a single process: nothing to exchange."""

    rank, world_size = 0, 1

    def gather(self, tensor: Tensor) -> Tensor:
        return tensor


class EvaluationFailed(RuntimeError):
    """Another rank's share of an evaluation failed; that rank raised the error itself."""


def run_everywhere(collectives: Collectives, device: torch.device | str, work: Callable[[], T]) -> T:
    """This rank's ``work()``, then one collective in which every rank learns whether every rank's work
    succeeded: all return, or all raise (the failing rank its own error, the others EvaluationFailed)."""
    error: BaseException | None = None
    try:
        result = work()
    except Exception as err:  # noqa: BLE001 (re-raised below, after the other ranks learned of it)
        error = err
    failed = collectives.gather(torch.tensor([error is not None], dtype=torch.int64, device=device))
    if error is not None:
        raise error
    if failed.any():
        ranks = failed.nonzero().flatten().tolist()
        raise EvaluationFailed(f"evaluation failed on rank(s) {ranks} (that rank's log says why)")
    return result


def gather_rows(collectives: Collectives, rows: Tensor, device: torch.device | str) -> Tensor:
    """Every rank's ``rows`` [n_r, ...] concatenated in rank order, for any n_r (0 included).

    A rank without rows may pass any empty tensor: the trailing shape comes from the ranks that have rows
    (they must agree). The dtype must be the same on every rank.
    """
    shape = [rows.dim(), *rows.shape] + [0] * (_MAX_DIMS - rows.dim())
    if rows.dim() > _MAX_DIMS:  # said after the gather, so that every rank raises
        shape = [-1] + [0] * _MAX_DIMS
    shapes = collectives.gather(torch.tensor([shape], dtype=torch.int64, device=device)).tolist()
    if any(shape[0] < 0 for shape in shapes):
        raise ValueError(f"gather_rows takes at most {_MAX_DIMS} dimensions; a rank had more")
    counts = [shape[1] if shape[0] else 0 for shape in shapes]
    trailing = {tuple(shape[2 : 1 + shape[0]]) for shape, n in zip(shapes, counts) if n}
    if len(trailing) > 1:  # the same verdict on every rank: all raise
        raise ValueError(f"ranks gathered rows of different shapes: {sorted(trailing)}")
    if not trailing:
        return rows.new_zeros((0,)).to(device)
    (trailing,) = trailing
    longest = max(counts)
    padded = torch.zeros((longest, *trailing), dtype=rows.dtype, device=device)
    if rows.numel():
        padded[: len(rows)] = rows.to(device)
    gathered = collectives.gather(padded)
    return torch.cat([gathered[r * longest : r * longest + n] for r, n in enumerate(counts)])
