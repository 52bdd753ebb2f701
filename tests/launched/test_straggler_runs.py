"""Stragglers named in real runs of 2 ranks (reliability/stragglers.py): one rank slowed by a SIGSTOP/SIGCONT
duty cycle (a throttled GPU, a busy host) is named, and the session's uninterrupted run (launched/conftest.py)
raises no warning. The slowed run then ends as a preempted job does when its ``deepspeed`` command gets
SIGTERM: the ranks save the step in flight instead of training on orphaned (reliability/preemption.py)."""

import signal
import threading
import time

import pytest
from fault_runs import MODULE, SIGNAL_AFTER, fault_args, last_complete, step_log, straggler_lines
from launching import Launch, all_gone
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


@pytest.mark.launcher
def test_a_duty_cycled_rank_is_named_and_sigterm_to_the_launcher_saves(toy_data, tmp_path):
    """Rank 1 runs 20% of the time (SIGSTOP 40 ms, SIGCONT 10 ms) from step 5: rank 0 names it within a few
    windows of 2 steps. Then SIGTERM to the ``deepspeed`` command alone: it exits at once (143),
    forwarding nothing on one node; the ranks see their launcher's parent gone, save the step in flight
    and exit, and launch.py with them: nothing of the run trains on."""
    out = tmp_path / "slowed"
    sets = ["train.log_every_steps=2", "train.straggler_windows=2", "train.steps=2000"]
    run = Launch(2, [*MODULE, *fault_args(toy_data, out, *sets)], tmp_path / "slowed.log")
    try:
        run.wait_for_step(SIGNAL_AFTER)
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
            while not straggler_lines(run.output()) and time.monotonic() - started < 60:
                assert run.proc.poll() is None, run.output()[-4000:]
                time.sleep(0.2)
        finally:
            done.set()
            cycler.join()
            rank1.send_signal(signal.SIGCONT)
            took = time.monotonic() - started
        processes = run.processes()
        signalled = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        code = run.wait(timeout=30)
        gone = all_gone(processes, timeout=60) + time.monotonic() - signalled
    finally:
        run.kill()
    lines = straggler_lines(run.output())
    print(f"rank 1 duty-cycled: named {took:.1f} s after the cycle began: {lines[:1]}")
    print(f"SIGTERM to the deepspeed launcher: every process of the run gone {gone:.1f} s after the signal")
    assert lines, run.output()[-4000:]
    # (which part it names depends on where the stops fell: its forwards or its requests to its loader)
    assert "rank 1 on " in lines[0] and "rank 0 on " not in lines[0]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    named = [e for e in events.Scalars("perf/straggler_rank") if e.value == 1.0]
    ratios = {e.step: e.value for e in events.Scalars("perf/straggler_ratio")}
    assert named and max(ratios[e.step] for e in named) > 1.5

    assert code in (-signal.SIGTERM, 128 + signal.SIGTERM), run.output()[-4000:]
    saved = last_complete(out)
    assert SIGNAL_AFTER < saved < 2000 and len(step_log(out)) == saved


def test_a_clean_run_names_no_straggler(uninterrupted):
    """The uninterrupted run of 30 steps, windows of 5 steps, the default settings: no warning."""
    events = EventAccumulator(str(uninterrupted.out / "tensorboard"))
    events.Reload()
    ratios = [e.value for e in events.Scalars("perf/straggler_ratio")]
    print(f"clean run: straggler ratios per window {[round(r, 2) for r in ratios]}")
    assert len(ratios) == 6 and not straggler_lines(uninterrupted.output)
