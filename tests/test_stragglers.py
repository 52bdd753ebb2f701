"""Stragglers named (reliability/stragglers.py): the verdict on given figures, then real runs of 2 ranks
through the launcher, one of them slowed by a SIGSTOP/SIGCONT duty cycle (a throttled GPU, a busy host), and
one left alone, which raises no warning."""

import signal
import threading
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_preemption import Run, data, train_args  # noqa: F401 (data: the fixture)

from eva_fastclip.reliability.stragglers import MIN_SHARE, WARN_AGAIN_AFTER_WINDOWS, Stragglers


def warmed_up(factor: float, windows: int) -> Stragglers:
    """Past the first window, which holds one-off work and is never judged."""
    stragglers = Stragglers(factor, windows)
    metrics, warning = window(stragglers, [0.2, 0.6])
    assert warning is None and metrics["perf/straggler_ratio"] == pytest.approx(3.0)
    return stragglers


def window(stragglers, forward, wait=None, steps=2, step_seconds=0.5, step=10):
    """The verdict on a window of ``steps`` steps: each rank's forward and loader-wait seconds in it."""
    wait = [0.0] * len(forward) if wait is None else wait
    forward, wait = torch.tensor(forward, dtype=torch.float64), torch.tensor(wait, dtype=torch.float64)
    return stragglers.end_window(forward, wait, steps, step_seconds, step)


def test_a_rank_behind_for_the_set_number_of_windows_is_named_once():
    stragglers = warmed_up(factor=1.5, windows=3)
    # per step: rank 2 spends 0.3 s of its own, the median rank 0.1 s: 3 times, 0.2 s = 40% of the step
    for n in range(1, 3):
        metrics, warning = window(stragglers, [0.2, 0.2, 0.6])
        assert warning is None, f"named after {n} window(s)"
    assert metrics == {"perf/straggler_ratio": pytest.approx(3.0), "perf/straggler_rank": 2.0}
    _, warning = window(stragglers, [0.2, 0.2, 0.6], step=30)
    assert warning.startswith("step 30: straggler(s)")
    assert "rank 2 on " in warning and "300 ms of its own work per step" in warning
    assert "median 100 ms, 3 windows in a row" in warning and "its forward" in warning
    assert "rank 0" not in warning and "rank 1" not in warning
    # still behind: not named again for a while, then again
    repeats = [window(stragglers, [0.2, 0.2, 0.6])[1] for _ in range(WARN_AGAIN_AFTER_WINDOWS)]
    assert repeats[:-1] == [None] * (WARN_AGAIN_AFTER_WINDOWS - 1) and repeats[-1] is not None


def test_a_window_in_time_breaks_the_run_of_windows():
    stragglers = warmed_up(factor=1.5, windows=2)
    assert window(stragglers, [0.2, 0.6])[1] is None
    assert window(stragglers, [0.2, 0.25])[1] is None  # 1.25 x: in time
    assert window(stragglers, [0.2, 0.6])[1] is None  # counts from 1 again
    assert "rank 1 on " in window(stragglers, [0.2, 0.6])[1]


def test_a_slow_loader_is_named_as_the_slow_part():
    stragglers = warmed_up(factor=1.5, windows=1)
    _, warning = window(stragglers, [0.2, 0.2], wait=[0.0, 0.4])
    assert "rank 1 on " in warning and "100 ms forward, 200 ms waiting for its loader" in warning
    assert "its loader (slow storage?) is the slow part" in warning


def test_an_excess_too_small_to_matter_or_a_factor_of_0_names_nobody():
    # 3 times the median, but 10 ms more of a 1 s step: the others hardly wait for it
    excess = MIN_SHARE * 1.0 / 2
    metrics, warning = window(warmed_up(1.5, 1), [0.01, 0.01 + 2 * excess], step_seconds=1.0)
    assert warning is None and metrics["perf/straggler_ratio"] > 1.5
    metrics, warning = window(warmed_up(0, 1), [0.2, 0.6])
    assert warning is None and metrics["perf/straggler_ratio"] == pytest.approx(3.0)


def test_one_rank_has_no_stragglers():
    assert window(Stragglers(1.5, 1), [0.2], wait=[0.0]) == ({}, None)


def straggler_lines(run) -> list[str]:
    return [line for line in run.text().splitlines() if "straggler(s) hold every step back" in line]


@pytest.mark.launcher
def test_a_duty_cycled_rank_is_named_and_a_clean_run_names_none(data, tmp_path):  # noqa: F811
    """Rank 1 runs 20% of the time (SIGSTOP 40 ms, SIGCONT 10 ms) from step 5: rank 0 names it within a few
    windows of 2 steps. The same run without the signals, with the default settings: no warning."""
    sets = ["train.log_every_steps=2", "train.straggler_windows=2", "train.steps=2000"]
    run = Run(train_args(data, tmp_path / "slowed", *sets), tmp_path / "slowed.log")
    run.wait_for_step(5)
    rank1 = run.rank(1)
    started, done = time.monotonic(), threading.Event()

    def duty_cycle():
        while not done.is_set():
            rank1.send_signal(signal.SIGSTOP)
            time.sleep(0.04)
            rank1.send_signal(signal.SIGCONT)
            time.sleep(0.01)

    cycler = threading.Thread(target=duty_cycle)
    cycler.start()
    try:
        while not straggler_lines(run) and time.monotonic() - started < 60:
            assert run.proc.poll() is None, run.text()[-4000:]
            time.sleep(0.2)
    finally:
        done.set()
        cycler.join()
        rank1.send_signal(signal.SIGCONT)
        took = time.monotonic() - started
        run.proc.terminate()  # the launcher ends the ranks (a preemption: they save and exit)
        run.wait(timeout=120)
    lines = straggler_lines(run)
    print(f"rank 1 duty-cycled: named {took:.1f} s after the cycle began: {lines[:1]}")
    assert lines, run.text()[-4000:]
    # (which part it names depends on where the stops fell: its forwards or its requests to its loader)
    assert "rank 1 on " in lines[0] and "rank 0 on " not in lines[0]
    events = EventAccumulator(str(tmp_path / "slowed" / "tensorboard"))
    events.Reload()
    named = [e for e in events.Scalars("perf/straggler_rank") if e.value == 1.0]
    ratios = {e.step: e.value for e in events.Scalars("perf/straggler_ratio")}
    assert named and max(ratios[e.step] for e in named) > 1.5

    clean = Run(train_args(data, tmp_path / "clean", "train.log_every_steps=5"), tmp_path / "clean.log")
    assert clean.wait() == 0, clean.text()[-4000:]
    events = EventAccumulator(str(tmp_path / "clean" / "tensorboard"))
    events.Reload()
    ratios = [e.value for e in events.Scalars("perf/straggler_ratio")]
    print(f"clean run: straggler ratios per window {[round(r, 2) for r in ratios]}")
    assert len(ratios) == 6 and not straggler_lines(clean)
