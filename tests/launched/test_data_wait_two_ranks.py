"""Every rank logs the data wait of the slowest rank (reliability/data_wait.py's ``slowest_rank``; the rest
is in tests/test_data_wait.py): two ranks on fake clocks, a piece of the session's 2-rank suite."""

import json

import pytest
import torch
import torch.distributed as dist
from data_wait_clock import FakeClock, TimedBatches, train

from eva_fastclip.reliability.data_wait import DataWait, slowest_rank

TWO_RANK_PIECES = ("data_wait",)


def slowest_rank_of_two(out):
    """Every rank of the 2-rank suite: its second batch takes 1 s (rank 0) or 3 s (rank 1)."""
    rank = dist.get_rank()
    clock = FakeClock()
    meter = DataWait(workers=1, samples_per_step=4, world_size=2, clock=clock)
    train(meter, clock, [TimedBatches(clock, [0.0, 1.0 + 2.0 * rank])], compute=1.0)
    metrics = meter.metrics(slowest_rank(meter.end_window(), torch.device("cpu"))[0])
    (out / f"{rank}.json").write_text(json.dumps(metrics))


def test_every_rank_logs_the_slowest_rank_s_wait(two_rank_suite):
    out = two_rank_suite("data_wait")
    # rank 0 waits 1 s of its 1 + 2 s, rank 1 3 s of its 1 + 4 s: both log rank 1's 3/5
    for rank in range(2):
        metrics = json.loads((out / f"{rank}.json").read_text())
        assert metrics["perf/data_wait_fraction"] == pytest.approx(3 / 5)
