"""Stragglers named (reliability/stragglers.py): the verdict on given figures. Real runs of 2 ranks, one of
them slowed, are in tests/launched/test_straggler_runs.py."""

import pytest
import torch

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
