"""Where a rank stands in an epoch, what a checkpoint keeps of it, and how a resumed run takes it up.

The position is the micro-batches yielded so far and, per loader worker, where its stream stood after its
latest batch (:class:`.Stream`'s state). A resumed run in the same layout rebuilds every stream there
(exactly as the uninterrupted run goes on); one in another layout re-tiles or skips what the epoch had
done (approximately). The workers read the position as it stood when they started.
"""

from __future__ import annotations

from typing import Any

from .epoch_plan import EpochPlan, EpochRest, Tiling


class EpochPosition:
    """A rank's position in ``epoch``; a new one yields the epoch from its start."""

    def __init__(self, epoch: int = 0) -> None:
        self.reset(epoch)

    def reset(self, epoch: int) -> None:
        """The next iteration yields ``epoch`` from its start."""
        self.epoch = epoch
        self.start = 0  # micro-batches of the epoch yielded before this iteration (a resumed epoch)
        self.offset = 0  # an approximately resumed epoch: batches or shards skipped, the streams' salt
        self.rest = EpochRest()  # what the epoch's batches tile (resumed on another layout: what was left)
        self.resume: dict[int, tuple] = {}  # worker -> the Stream state to continue from
        self.streams: dict[int, tuple] = {}  # worker -> its Stream state after its latest batch yielded
        self.batches = 0  # micro-batches of the epoch yielded so far

    def begin(self) -> None:
        """An iteration starts: from the resumed position (or the epoch's start)."""
        self.batches, self.streams = self.start, dict(self.resume)

    def advance(self, worker: int, stream: tuple) -> None:
        """``worker`` yielded a batch, after which its stream stood at ``stream``."""
        self.streams[worker] = tuple(stream)
        self.batches += 1

    def state_dict(self, layout: dict[str, Any], skipped: dict[str, int]) -> dict[str, Any]:
        """The position after the micro-batches yielded so far, in ``layout``, with the skips so far."""
        return {
            "epoch": self.epoch,
            "batches": self.batches,
            "offset": self.offset,
            "streams": dict(self.streams),
            "layout": layout,
            "rest": self.rest.state(),
            "skipped": skipped,
        }

    def resume_at(
        self,
        batches: int,
        state: dict[str, Any] | None,
        *,
        layout: dict[str, Any],
        plan: EpochPlan,
        tiling: Tiling,
        resampled: bool,
    ) -> bool:
        """Take up this epoch after its first ``batches`` micro-batches, from ``state`` (a
        :meth:`state_dict`) saved in some layout; ``layout``, ``plan`` and ``tiling`` are this run's.
        Returns whether exactly (the same layout): TrainLoader.resume says how otherwise."""
        self.start = self.batches = batches
        if state is not None and (state["epoch"], state["batches"], state["layout"]) == (
            self.epoch,
            batches,
            layout,
        ):
            self.offset = state["offset"]
            self.rest = EpochRest.from_state(state.get("rest"))
            self.resume = {int(worker): tuple(stream) for worker, stream in state["streams"].items()}
            self.streams = dict(self.resume)
            return True
        if resampled:
            self.offset = batches  # a salt: a stream of its own
        elif plan.by_samples:
            self.offset = batches
            done, done_rest, batches_done = tiling, EpochRest(), batches
            if state is not None and state["epoch"] == self.epoch and _same_plan(state["layout"], layout):
                saved = state["layout"]
                done = Tiling(*(saved[key] for key in ("world_size", "workers", "batch_size", "num_batches")))
                done_rest, batches_done = EpochRest.from_state(state.get("rest")), state["batches"]
            self.rest = plan.rest_after(done, done_rest, batches_done, first_batch=batches)
        else:
            self.offset = plan.whole_shards_done(batches)
        return False


def _same_plan(layout: dict[str, Any], mine: dict[str, Any]) -> bool:
    """Whether a position saved with ``layout`` is in the sample sequence of this run's (``mine``)."""
    return all(layout.get(key) == mine[key] for key in ("seed", "resampled", "shards", "plan"))
