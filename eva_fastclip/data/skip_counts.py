"""The training loader's count of skipped samples, by reason, over its workers, epochs and resumes.

Each worker counts its own stream's skips (:class:`.FailureLog`) and every batch carries them as they
stood at its last sample, so the totals cover exactly the samples the yielded batches were drawn past,
whatever the workers had read ahead, and a resumed run counts as the uninterrupted one does.
"""

from __future__ import annotations

from .tar_reader import SKIP_REASONS


class SkipCounts:
    """Skipped samples: those of the iterations before this one, and each worker's in this one."""

    def __init__(self) -> None:
        self._before = [0] * len(SKIP_REASONS)  # skips of the iterations before this one
        self._by_worker: dict[int, tuple[int, ...]] = {}  # worker -> its skips up to its latest batch yielded

    def by_reason(self) -> dict[str, int]:
        """Every one of :data:`SKIP_REASONS`, zero where none was skipped."""
        counts = [sum(column) for column in zip(self._before, *self._by_worker.values())]
        return dict(zip(SKIP_REASONS, counts))

    def load(self, by_reason: dict[str, int]) -> None:
        """Count on from a resumed run's skips."""
        self._before = [int(by_reason.get(reason, 0)) for reason in SKIP_REASONS]
        self._by_worker = {}

    def restart(self) -> None:
        """A new iteration: its workers' streams start counting anew."""
        self._before = list(self.by_reason().values())
        self._by_worker = {}

    def note(self, worker: int, skips: tuple[int, ...]) -> None:
        """``worker``'s skips up to the batch it just yielded."""
        self._by_worker[worker] = tuple(skips)
