"""`eva-fastclip tune` on 2 ranks (tests/test_tune.py has the rest): an out-of-memory probe agreed by every
rank (a piece of the session's 2-rank suite), and the search launched as a user launches it."""

import json

import pytest
import torch.distributed as dist
from launching import run_ranks
from tune_cases import MIB, REPO, toy_overrides

from eva_fastclip.config import load_config
from eva_fastclip.data import write_toy_dataset
from eva_fastclip.plan.deepspeed_json import load_deepspeed_config
from eva_fastclip.tune.layouts import Candidate
from eva_fastclip.tune.probe import model_probe

TWO_RANK_PIECES = ("tune_out_of_memory",)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune_toy")
    write_toy_dataset(out, num_train=1024, num_val=16, num_zeroshot=16, samples_per_shard=256, seed=0)
    return out


# ---- out of memory agreed across ranks ----------------------------------------------------------------


def agree_out_of_memory(out):
    """Every rank of the 2-rank suite: a probe over a 48 MiB limit, then the same probe without one. Probes
    train on synthetic batches (plan/run_plan.py neither checks nor reads shards for them): the config's
    shards are toy.json's own."""
    rank = dist.get_rank()
    overrides = ["data.workers=1", "train.batch_size=null", "train.global_batch=64"]
    cfg = load_config(REPO / "configs/toy.json", [*overrides, f"train.output_dir={out / 'out'}"])
    ds = load_deepspeed_config(REPO / cfg.train.deepspeed_config)
    candidate = Candidate(32, 2, "micro", False, 1, 2)
    shape = dict(image_shape=(3, 64, 64), context_length=32, output_dir=str(out / "out"))
    # both ranks run out at the same allocation (the ranks are symmetric); the flag is all-reduced after
    first = model_probe(cfg, ds, candidate, limit=48 * MIB, steps=1, **shape)
    second = model_probe(cfg, ds, candidate, limit=None, steps=1, **shape)
    (out / f"{rank}.json").write_text(json.dumps([first.oom, second.oom, second.peak]))
    dist.barrier()


def test_an_out_of_memory_probe_is_agreed_and_the_next_runs_on_every_rank(two_rank_suite):
    out = two_rank_suite("tune_out_of_memory")
    results = [json.loads((out / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert [r[0] for r in results] == [True, True]
    assert [r[1] for r in results] == [False, False]  # the process group and memory survived it
    assert results[0][2] == results[1][2] > 0  # the largest peak of the ranks, agreed


def test_tune_on_two_ranks_fits_a_limit_between_two_measured_peaks_and_trains(toy, tmp_path, rank_pool):
    """The issue's command, then again with a limit between the peaks its first run measured for the two
    largest micro-batches, then 2 training steps of that tuned config: one launch of 2 ranks from the rank
    pool (tests/launched_tune.py). No hang watchdog: none is under test here."""
    # the command, at a global batch of 64 (2 x 32) rather than 128: probes of half the work
    overrides = toy_overrides(toy, tmp_path / "run", global_batch=64)
    overrides.append("train.hang_timeout_s=0")
    config_args = ["--config", "configs/toy.json", *[a for o in overrides for a in ("--set", o)]]
    program = ["tests/launched_tune.py", str(tmp_path), *config_args]
    out = run_ranks(2, program, tmp_path / "launch.log", pool=rank_pool)
    assert [json.loads((tmp_path / f"codes_rank_{r}.json").read_text()) for r in (0, 1)] == [[0, 0, 0]] * 2

    first = tmp_path / "first.json"
    rows = json.loads(first.with_name("first.trials.json").read_text())["trials"]
    measured = sorted(
        (
            r
            for r in rows
            if r["peak_gib"] is not None and r["zero_stage"] == 0 and not r["grad_checkpointing"]
        ),
        key=lambda r: -r["micro_batch"],
    )
    largest, next_one = measured[0], measured[1]
    assert (largest["micro_batch"], next_one["micro_batch"]) == (32, 16)
    assert largest["peak_gib"] > next_one["peak_gib"]
    assert json.loads(first.read_text())["tuned"]["why"]["data.workers"].startswith("1:")

    limit = float((tmp_path / "limit.txt").read_text())
    assert next_one["peak_gib"] < limit < largest["peak_gib"]
    second = tmp_path / "second.json"
    payload = json.loads(second.with_name("second.trials.json").read_text())
    chosen = [r for r in payload["trials"] if r["verdict"] == "chosen"]
    assert len(chosen) == 1 and chosen[0]["peak_gib"] is not None and chosen[0]["peak_gib"] <= limit
    same_as_largest = [
        r for r in payload["trials"]
        if (r["micro_batch"], r["zero_stage"], r["grad_checkpointing"], r["contrastive_mode"])
        == (32, 0, False, "micro")
    ]  # fmt: skip
    assert same_as_largest[0]["verdict"] in ("over_limit", "oom")
    assert "chosen:" in out and f"memory limit {limit:.3g} GiB" in out

    tuned = load_config(second)
    assert tuned.train.global_batch == 64 and tuned.train.max_micro_batch == chosen[0]["micro_batch"]
    trained = tmp_path / "trained"
    assert (trained / "checkpoints" / "step_00000002").is_dir()
    steps = [json.loads(line) for line in (trained / "train_log.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
