"""Ranks sharing an evaluation, as threads of this process: ``on_ranks(world, work)`` runs ``work`` on
``world`` threads, each with a ``ThreadRank`` whose ``gather`` stands in for the all-gather of a real
process group (tests/test_evaluation.py, test_winogavil.py, test_datacomp.py)."""

import threading

import torch

from eva_fastclip.data.workers import start_worker_server


class ThreadRank:
    """Rank ``rank`` of a group of threads: ``gather`` concatenates every thread's tensor (and checks
    they are equally shaped, as NCCL's all_gather needs); a missing peer breaks the barrier in 30 s
    instead of hanging the test."""

    def __init__(self, group: dict, rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, group["world"]
        self.calls = 0

    def gather(self, tensor):
        group = self.group
        group["slots"][self.rank] = tensor.clone()
        group["barrier"].wait()
        shapes = {tuple(t.shape) for t in group["slots"]}
        out = torch.cat(group["slots"])
        group["barrier"].wait()
        assert len(shapes) == 1, f"ranks gathered different shapes {shapes}"
        self.calls += 1
        return out


def on_ranks(world: int, work):
    """``work(collectives)`` on ``world`` threads; returns each rank's result or exception."""
    group = {"world": world, "slots": [None] * world, "barrier": threading.Barrier(world, timeout=30)}
    results = [None] * world
    # the loaders' fork server dies with the thread that starts it (PR_SET_PDEATHSIG follows the thread):
    # started here, from the main thread, it outlives the rank threads, as it outlives nothing in a rank
    start_worker_server()

    def run(rank):
        try:
            results[rank] = work(ThreadRank(group, rank))
        except BaseException as err:  # noqa: BLE001
            results[rank] = err

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a rank is stuck"
    return results
