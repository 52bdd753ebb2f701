"""A 2-rank toy run whose shards sit in an S3 server (moto's, started by rank 0 on the loopback, spoken to
over HTTP by s3fs): its per-step losses are the run's from the local folder, with no data.num_samples set
(the manifest is read from the bucket), also when the server cuts every shard's first transfer halfway
(the retries logged); with a shard that stays unreachable the run saves and stops on both ranks, naming
the shard and the byte, and a resume once the server answers again ends as the uninterrupted run does.
One piece of the shared 2-rank launch (two_rank_suite.py)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch.distributed as dist
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TWO_RANK_PIECES = ("remote_data",)
STEPS = 8  # 256 samples in 4 shards of 64, 2 x 16 a step: one epoch, 2 shards a rank


def _config(out: Path, shards: str, name: str, *sets: str):
    from eva_fastclip.config import load_config

    return load_config(
        "configs/toy.json",
        [
            "model.name=test-vit-xs",
            "loss.name=fastclip_v3",
            f'data.train_shards=["{shards}"]',
            "data.workers=0",  # the retries in the rank's own log (workers: tests/test_remote_data.py)
            "data.shuffle_buffer=16",
            "data.read_retries=2",
            "data.retry_wait_s=0.05",
            "train.batch_size=16",
            f"train.steps={STEPS}",
            "train.log_every_steps=1",
            f"train.save_every_steps={STEPS}",
            f"train.output_dir={out / name}",
            "train.precision=fp32",
            "optim.warmup_steps=2",
            "eval.zeroshot_dir=null",
            "eval.retrieval_shards=null",
            *sets,
        ],
    )


def _train(cfg, resume: str | None = None) -> None:
    from eva_fastclip.engine.build import build_trainer
    from eva_fastclip.plan.deepspeed_json import load_deepspeed_config

    build_trainer(cfg, load_deepspeed_config(cfg.train.deepspeed_config), resume=resume).train()


def remote_runs(out: Path) -> None:
    """Every rank: the same toy run from the local folder, from S3, from S3 with every shard's first
    transfer cut, from S3 with one shard unreachable (DataUnavailable expected) and its resume."""
    from benchmarks.object_store import start_s3
    from eva_fastclip.data import write_toy_dataset
    from eva_fastclip.engine.step_batches import DataUnavailable

    rank = dist.get_rank()
    data, server = out / "toy", None
    if rank == 0:
        write_toy_dataset(data, num_train=256, num_val=16, num_zeroshot=20, samples_per_shard=64, seed=0)
        server = start_s3()
        url = server.upload(data / "train", "toy/train")
    shared = [server.environment() if server else None, url if server else None]
    dist.broadcast_object_list(shared, src=0)
    environment, url = shared
    os.environ.update(environment)
    _train(_config(out, str(data / "train"), "local"))
    _train(_config(out, url, "s3"))
    if server:
        server.faults.cut = 0.5
    dist.barrier()
    retries = logging.FileHandler(out / f"retries_rank{rank}.log")
    logging.getLogger("eva_fastclip.data.remote").addHandler(retries)
    _train(_config(out, url, "s3_cut"))
    logging.getLogger("eva_fastclip.data.remote").removeHandler(retries)
    retries.close()
    # rank 0's second shard of the epoch (read mid-epoch: the stop is agreed at a step's end), then its
    # first (read before the first step: agreed at the epoch's start)
    order = [f"shard-{shard:06d}.tar" for shard in _shard_order(_config(out, url, "any"))]
    for name, unreachable in (("s3_unreachable", order[1]), ("s3_unreachable_at_start", order[0])):
        if server:
            (out / "served.json").write_text(json.dumps(dict(server.faults.served)))
            server.faults.clear()
            server.faults.unreachable = {unreachable}
        dist.barrier()
        try:
            _train(_config(out, url, name))
        except DataUnavailable as err:
            (out / f"{name}_rank{rank}.txt").write_text(f"{unreachable}\n{err}")
        dist.barrier()
    if server:
        server.faults.clear()
    dist.barrier()
    _train(_config(out, url, "s3_unreachable"), resume="latest")
    dist.barrier()
    if server:
        server.stop()


def _shard_order(cfg) -> list[int]:
    """The shards' order in the toy run's epoch 0 (every rank's: data/epoch_plan.py)."""
    from eva_fastclip.data.epoch_plan import EpochPlan, Tiling

    tiling = Tiling(world_size=2, workers=0, batch_size=16, num_batches=STEPS)
    plan = EpochPlan([str(i) for i in range(4)], [64] * 4, seed=cfg.train.seed, tiling=tiling)
    return plan.shard_order(0, 0)


def losses(run: Path) -> list[float]:
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return [event.value for event in events.Scalars("train/loss")]


@pytest.fixture(scope="module")
def out(two_rank_suite):
    return two_rank_suite("remote_data")


def test_a_run_from_s3_is_the_run_from_its_folder(out):
    local = losses(out / "local")
    assert len(local) == STEPS
    for run in ("s3", "s3_cut"):
        assert losses(out / run) == pytest.approx(local, abs=1e-6), run
    config = json.loads((out / "s3" / "config.json").read_text())
    assert config["data"]["num_samples"] in (None, 256)  # not set: read from the bucket's manifest


def test_cut_transfers_are_retried_and_logged(out):
    served = json.loads((out / "served.json").read_text())
    assert served["cut"] >= 4  # each of the 4 shards' first transfer (a shard split between ranks: more)
    logged = "".join((out / f"retries_rank{rank}.log").read_text() for rank in range(2))
    assert logged.count("retry 1 of 2") == served["cut"], logged
    assert "s3://shards/toy/train/shard-0000" in logged and " at byte 0: " in logged


@pytest.mark.parametrize("run", ["s3_unreachable", "s3_unreachable_at_start"])
def test_an_unreachable_shard_saves_and_stops_every_rank(out, run):
    """Both ranks stop at the same step with the same line, naming the shard, the byte and the error, and
    the step's checkpoint is complete: mid-epoch (the next step's fetch failed) and at the epoch's start."""
    texts = [(out / f"{run}_rank{rank}.txt").read_text().split("\n", 1) for rank in range(2)]
    (unreachable, message), (_, other) = texts
    assert message == other
    assert f"{unreachable} at byte 0: " in message and "(after 2 retries)" in message
    step = int(message.split(":", 1)[0].removeprefix("step "))
    assert (step > 0) == (run == "s3_unreachable"), message
    assert (out / run / "checkpoints" / f"step_{step:08d}" / "COMPLETE.json").is_file()
    print(f"{run}: {message}")


def test_the_resume_once_the_shard_answers_ends_as_the_uninterrupted_run(out):
    """The stopped run's steps, then the resumed run's: the uninterrupted run's losses."""
    assert losses(out / "s3_unreachable") == pytest.approx(losses(out / "local"), abs=1e-6)
