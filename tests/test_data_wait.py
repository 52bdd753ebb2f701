"""The trainer's measure of the time steps wait on data (reliability/data_wait.py): exact window metrics on a
fake clock, the workers-needed formula against the rates it comes from, the warning's cadence; and a real
(one-rank, in-process) run with a loader that sleeps per batch and one that does not. Every rank logs the
slowest rank's wait: tests/launched/test_data_wait_two_ranks.py."""

import logging
import math
import re
import time
from fractions import Fraction

import pytest
import torch
from data_wait_clock import FakeClock, TimedBatches, train

from eva_fastclip.reliability.data_wait import WARN_AGAIN_AFTER_S, DataWait, Window, workers_needed


def test_a_window_s_fractions_are_exact():
    clock = FakeClock()
    meter = DataWait(workers=2, samples_per_step=4, world_size=2, clock=clock)
    # the first batch (the epoch's opening 1 s + 2 s) is start-up; then 1 s and 0.5 s waits, 3 s steps
    epoch = TimedBatches(clock, [2.0, 1.0, 0.5], opening=1.0)
    train(meter, clock, [epoch], compute=3.0)
    window = meter.end_window()
    assert window == Window(steps=3, wall=3.0 + 4.0 + 3.5, wait=1.5, startup=3.0)
    metrics = meter.metrics(window)
    assert metrics == {
        "perf/data_wait_fraction": 1.5 / 10.5,
        "perf/samples_per_second": 3 * 4 * 2 / 10.5,
        "perf/step_seconds": 10.5 / 3,
        "perf/loader_startup_seconds": 3.0,
    }
    assert meter.end_window() == Window(0, 0.0, 0.0, 0.0)  # the next window starts empty


def test_a_step_across_an_epoch_s_end_leaves_the_change_of_epoch_out():
    clock = FakeClock()
    meter = DataWait(workers=1, samples_per_step=2, world_size=1, clock=clock)
    # 2 micro-batches a step, 3 per epoch: step 2 takes the last of epoch 0 and the first of epoch 1
    first = TimedBatches(clock, [5.0, 1.0, 1.0], closing=7.0)
    second = TimedBatches(clock, [9.0, 1.0, 1.0], opening=2.0)
    train(meter, clock, [first, second], compute=0.5, accum=2)
    window = meter.end_window()
    # step 1: 0.5 + 1 + 0.5 (its start-up 5 s out); step 2: 1 + 0.5 + (7 + 11 out) + 0.5;
    # step 3: 1 + 0.5 + 1 + 0.5
    assert window.steps == 3
    assert window.wall == pytest.approx(2.0 + 2.0 + 3.0)
    assert window.wait == pytest.approx(1.0 + 1.0 + 2.0)
    assert window.startup == pytest.approx(5.0 + 7.0 + 11.0)


def rate_based(wall, wait, workers, samples=1000):
    """Workers needed from the rates, in exact arithmetic: the loader ran flat out at S / wall samples/s
    on N workers (on the training process when N = 0), the steps' own work asks for S / (wall - wait)."""
    wall, wait = Fraction(wall), Fraction(wait)
    compute = wall - wait
    # with no workers the training process is the one loader: samples / wait
    per_worker = Fraction(samples) / (wait if workers == 0 else wall * workers)
    return math.ceil(Fraction(samples) / compute / per_worker)


@pytest.mark.parametrize(
    "wall, wait, workers, expected",
    [(10, 5, 2, 4), (8, 2, 3, 4), (4, 3, 0, 3), (5, 1, 0, 1), (10, 1, 8, 9), (10, 9, 1, 10)],
)
def test_workers_needed_is_the_rates_formula(wall, wait, workers, expected):
    assert rate_based(wall, wait, workers) == expected
    assert workers_needed(wait / wall, workers) == expected


def test_workers_needed_matches_the_rates_on_random_windows():
    g = torch.Generator().manual_seed(0)
    for _ in range(500):  # in hundredths of a second: the reference is exact
        wall = int(torch.randint(2, 10_000, (1,), generator=g))
        wait = int(torch.randint(1, wall, (1,), generator=g))
        workers = int(torch.randint(0, 65, (1,), generator=g))
        expected = rate_based(Fraction(wall, 100), Fraction(wait, 100), workers)
        assert workers_needed((wait / 100) / (wall / 100), workers) == expected, (wall, wait, workers)
    assert workers_needed(1.0, 4) is None  # nothing but waiting: no rate of the steps to keep up with


def window(fraction, steps=10, wall=20.0):
    return Window(steps=steps, wall=wall, wait=fraction * wall, startup=0.0)


def test_the_warning_names_the_rates_and_the_workers_then_keeps_quiet():
    clock = FakeClock()
    meter = DataWait(workers=2, samples_per_step=64, world_size=8, cores=8, clock=clock)
    assert meter.warning(window(0.10), step=10) is None  # at the threshold: no warning
    text = meter.warning(window(0.5), step=20)
    # 640 samples in 20 s, 10 s of own work: 32 samples/s delivered, 64 asked; 2 / (1 - 0.5) = 4 workers
    assert text.startswith("steps 11-20: training waited on data 50% of the time")
    assert "32.0 samples/s per rank" in text and "takes 64.0" in text
    assert "data.workers=2 per rank cannot keep up" in text and "data.workers=4 would" in text
    assert "CPU cores" not in text
    clock.now += 60
    assert meter.warning(window(0.5), step=30) is None  # the same a minute later: quiet
    clock.now += 60
    worse = meter.warning(window(0.6), step=40)  # 2 / 0.4 = 5 workers: more than it said
    assert worse and "data.workers=5 would" in worse
    clock.now += WARN_AGAIN_AFTER_S - 1
    assert meter.warning(window(0.55), step=50) is None
    clock.now += 1
    assert "data.workers=5 would" in meter.warning(window(0.55), step=60)  # ten minutes on: again


def test_the_warning_says_when_the_workers_needed_exceed_the_cores():
    clock = FakeClock()
    meter = DataWait(workers=0, samples_per_step=8, world_size=1, cores=2, clock=clock)
    text = meter.warning(window(0.8), step=10)  # 0.8 / 0.2 = 4 workers on 2 cores
    assert "data.workers=0 loads in the training process" in text and "data.workers=4 would" in text
    assert "more than the 2 CPU cores per rank" in text


# ---- a real run ---------------------------------------------------------------------------------------

BATCH, SLEEP = 8, 0.5


class SleepingBatches:
    """A stand-in loader whose every batch takes ``sleep`` seconds to arrive."""

    def __init__(self, sleep):
        g = torch.Generator().manual_seed(0)
        self.batches = [
            (
                torch.randn(BATCH, 3, 32, 32, generator=g),
                torch.randint(1, 49000, (BATCH, 16), generator=g),
                torch.randperm(64, generator=g)[:BATCH],
            )
            for _ in range(6)
        ]
        self.sleep = sleep
        self.num_batches, self.dataset_size, self.num_samples = 6, 64, 64
        self.delivery_seconds = []  # each batch's time inside the loader: the sleep, plus any overrun

    def set_epoch(self, epoch):
        pass

    def __iter__(self):
        for batch in self.batches:
            start = time.perf_counter()
            time.sleep(self.sleep)
            self.delivery_seconds.append(time.perf_counter() - start)
            yield batch


def perf_scalars(output_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(output_dir / "tensorboard"))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"] if "perf/" in tag}


@pytest.mark.parametrize("sleep", [SLEEP, 0.0])
def test_a_run_measures_its_wait_on_data(tmp_path, caplog, sleep):
    from eva_fastclip.config import load_config
    from eva_fastclip.engine.build import build_trainer
    from eva_fastclip.plan.deepspeed_json import load_deepspeed_config

    cfg = load_config(
        "configs/toy.json",
        [
            "model.name=test-vit-xs",
            "loss.name=fastclip_v3",
            f"train.batch_size={BATCH}",
            f"train.output_dir={tmp_path}",
            "train.steps=4",
            "train.log_every_steps=2",
            "train.precision=fp32",  # on every CPU kind
            "data.workers=2",
            "optim.warmup_steps=1",
            "eval.zeroshot_dir=null",
            "eval.retrieval_shards=null",
        ],
    )
    loader = SleepingBatches(sleep)
    trainer = build_trainer(cfg, load_deepspeed_config(cfg.train.deepspeed_config), loader=loader)
    with caplog.at_level(logging.WARNING, logger="eva_fastclip"):
        trainer.train()
    perf = perf_scalars(tmp_path)
    assert len(perf["perf/data_wait_fraction"]) == 2  # steps 2 and 4
    # the first batch's sleep is loader start-up, apart; every later step waited one sleep
    assert perf["perf/loader_startup_seconds"][0] >= sleep
    fraction, step_seconds = perf["perf/data_wait_fraction"][-1], perf["perf/step_seconds"][-1]
    # the wait per step is the loader's own time for steps 3-4's batches: the sleep, and what a busy
    # machine adds to a sleep (the CI's 0.5 s sleeps have overrun by 0.06 s)
    delivered = loader.delivery_seconds[2:4]
    assert fraction * step_seconds == pytest.approx(sum(delivered) / 2, abs=0.02)
    assert min(delivered) >= sleep
    assert perf["perf/samples_per_second"][-1] == pytest.approx(BATCH / step_seconds, rel=1e-4)
    warnings = [r.getMessage() for r in caplog.records if "waited on data" in r.getMessage()]
    if sleep:
        assert fraction > 0.1
        assert warnings and "data.workers=2 per rank cannot keep up" in warnings[0], warnings
        needed = math.ceil(2 / (1 - fraction) - 1e-9)
        named = [int(n) for n in re.findall(r"data\.workers=(\d+) would", warnings[-1])]
        if warnings[-1].startswith("steps 3-4"):
            assert named == [needed], warnings
        else:  # not repeated for a window that needs no more than the last warning said (a busy machine's
            assert named and named[0] >= needed, warnings  # steps 1-2 may have needed more)
    else:
        assert fraction < 0.05 and not warnings
