"""The DataLoader that runs the training pipeline in a rank's loader workers, and the name of a dead one.

The workers come from the rank's fork server (data/workers.py), ignore the stop signals (the rank
finishes its step and saves) and hand over their batches, page-locked if asked. A worker killed under
the rank (the kernel's OOM killer) is named with its exit code rather than left as a broken pipe.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from .remote import ShardUnreachable
from .workers import worker_context, worker_init


def train_dataloader(pipeline: IterableDataset, *, workers: int, seed: int, pin_memory: bool) -> DataLoader:
    """A DataLoader of ``pipeline``'s batches (already batched) from ``workers`` processes (0: this one)."""
    return DataLoader(
        pipeline,
        batch_size=None,
        num_workers=workers,
        persistent_workers=False,
        # not forked from the rank, whose previous loader's threads may be exiting (data/workers.py)
        multiprocessing_context=worker_context() if workers else None,
        pin_memory=pin_memory,  # page-locked batches: the copy to the GPU runs asynchronously
        # a generator of its own for the workers' base seed (which nothing uses): starting a loader
        # must not draw from the global one, which masks patches in the training step
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=worker_init(),  # the rank's environment; the rank finishes its step and saves
    )


def naming_dead_workers(
    batches: Iterator[Any], workers: Sequence[Any], rank: int, loader_iterator: Any = None
) -> Iterator[Any]:
    """``batches``; a failure while a worker has died (the OOM killer: PyTorch names it, or its queue's
    pipe breaks first, naming nobody) is raised again naming the dead workers, once the loader's other
    workers are ended here (:func:`_abandon`)."""
    try:
        yield from batches
    except ShardUnreachable:  # a worker's own verdict, raised again here by the loader: not a death
        raise
    except (RuntimeError, OSError, EOFError) as err:
        # a broken pipe comes a moment before the fork server reports the worker's end (PyTorch's own
        # RuntimeError names it already)
        patience = 0.0 if isinstance(err, RuntimeError) else 5.0
        deadline = time.monotonic() + patience
        while not (dead := [worker for worker in workers if not worker.is_alive()]):
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)
        _abandon(loader_iterator, workers)
        codes = ", ".join(f"pid {worker.pid} (exit code {worker.exitcode})" for worker in dead)
        raise RuntimeError(
            f"rank {rank}'s training loader worker(s) died: {codes}; a negative code is the signal that "
            "ended it (-9: SIGKILL, e.g. the kernel's OOM killer: give them more memory, or use fewer)"
        ) from err


def _abandon(loader_iterator: Any, workers: Sequence[Any]) -> None:
    """A worker killed while it held one of the loader's shared locks (its workers-done event's, which
    every worker takes to read it, or the result queue's) leaves it held for good, and PyTorch's own
    shutdown of the loader (when the iterator is collected) sets that event: it waited forever, the rank
    hung after naming the dead worker. So the other workers are ended here and the iterator is told it is
    shut down; its queues let the process exit without flushing to workers that are gone."""
    for worker in workers:
        if worker.is_alive():
            worker.kill()
    for worker in workers:
        worker.join(timeout=5)
    if loader_iterator is None:
        return
    loader_iterator._shutdown = True
    queues = [
        *getattr(loader_iterator, "_index_queues", ()),
        getattr(loader_iterator, "_worker_result_queue", None),
    ]
    for queue in queues:
        if queue is not None:
            queue.cancel_join_thread()
            queue.close()
