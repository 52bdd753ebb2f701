"""`eva-fastclip loader-speed` on a tiny toy dataset: our TrainLoader built from the config as training
builds it, one row per worker count with the samples it timed and positive rates (no timing is asserted),
and preflight's errors for shards that are not there."""

from pathlib import Path

import pytest

from eva_fastclip.cli import main
from eva_fastclip.commands.loader_speed import format_report, loader_speed
from eva_fastclip.config import load_config
from eva_fastclip.data import write_toy_dataset
from eva_fastclip.data.throughput import descendants

TOY_CONFIG = str(Path(__file__).parents[1] / "configs" / "toy.json")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    write_toy_dataset(root, num_train=128, num_val=8, num_zeroshot=20, image_size=16, samples_per_shard=32)
    return root


def sets(shards) -> list[str]:
    return [f'data.train_shards=["{shards}"]', "train.batch_size=8"]


def test_one_row_per_worker_count_with_the_samples_it_timed(toy):
    before = set(descendants())
    cfg = load_config(TOY_CONFIG, sets(toy / "train"))
    results = loader_speed(cfg, [0, 1], warmup=1, batches=3)
    assert results["micro_batch"] == 8 and results["samples_per_epoch"] == 128 and results["shards"] == 4
    assert [row["workers"] for row in results["rows"]] == [0, 1]
    for row in results["rows"]:
        assert row["samples"] == 3 * 8 and row["timed_batches"] == 3
        assert row["samples_per_s"] > 0 and row["samples_per_cpu_s"] > 0
        assert row["wall_s"] > 0 and row["cpu_s"] > 0
        assert row["image_dtype"] == "uint8" and row["token_shape"][0] == 8
    assert results["rows"][0]["worker_peak_rss_mib"] == 0  # no worker: the loader ran in this process
    assert results["rows"][1]["worker_peak_rss_mib"] > 0
    report = format_report(results)
    assert "data.workers=" in report and "keeps up with a rank training at up to" in report
    # every worker stopped; what stays is the workers' fork server and multiprocessing's resource tracker
    left = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in set(descendants()) - before]
    assert all(b"forkserver" in cmd or b"resource_tracker" in cmd for cmd in left), left


def test_the_command_prints_a_row_per_worker_count(toy, capsys):
    args = ["loader-speed", "--config", TOY_CONFIG, "--workers", "0", "--batches", "2", "--warmup", "1"]
    assert main([*args, *(x for s in sets(toy / "train") for x in ("--set", s))]) == 0
    out = capsys.readouterr().out
    assert "TrainLoader on data.train_shards (4 shard(s), 128 samples an epoch)" in out
    assert "data.workers=0 keeps up with" in out


def test_missing_shards_give_preflights_errors_before_any_work(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    for shards in (tmp_path / "nowhere", empty):
        argv = ["loader-speed", "--config", TOY_CONFIG, *(x for s in sets(shards) for x in ("--set", s))]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("eva-fastclip loader-speed: error: 1 problem(s) before step 1:"), err
        assert "data.train_shards:" in err and "point it at existing shards" in err


def test_a_window_longer_than_an_epoch_is_refused(toy, capsys):
    argv = ["loader-speed", "--config", TOY_CONFIG, "--workers", "1", "--batches", "20"]
    assert main([*argv, *(x for s in sets(toy / "train") for x in ("--set", s))]) == 2
    assert "an epoch of the shards holds 16 micro-batches of 8" in capsys.readouterr().err
