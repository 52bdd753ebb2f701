"""Stragglers named in real runs of 2 ranks (reliability/stragglers.py): one rank slowed by a SIGSTOP/SIGCONT
duty cycle (a throttled GPU, a busy host) is named, and the session's uninterrupted run (launched/conftest.py)
raises no warning. The slowed run is a SLURM job: launchers/slurm.sbatch run by bash as sbatch would (SLURM's
environment set, a stand-in ``scontrol`` on PATH that names this host and records a requeue). While it trains,
a second run started on its output folder is refused (reliability/run_lock.py); then SIGUSR1 reaches every
process of the job (``scancel --full --signal=USR1``): the runner and launch.py die of it, the ranks save the
step in flight, and the batch script still returns 75 (the launch supervisor collects it) and requeues the
job. (SLURM's ``--signal=B:USR1``, to the batch shell alone: tests/launched/test_multi_node.py.)"""

import json
import os
import signal
import threading
import time

import psutil
import pytest
from fault_runs import MODULE, SIGNAL_AFTER, fault_args, last_complete, step_log, straggler_lines
from launching import REPO, Launch, all_gone, run_ranks
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from eva_fastclip.reliability.preemption import PREEMPTED_EXIT_CODE

SBATCH = REPO / "launchers" / "slurm.sbatch"
JOB_ID = "4242"


def fake_slurm(tmp_path):
    """SLURM's batch environment for this host, and a PATH entry whose ``scontrol`` answers ``show
    hostnames`` with this host and records ``requeue``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        "#!/usr/bin/env bash\n"
        'case "$1 $2" in\n'
        '  "show hostnames") hostname ;;\n'
        f'  "requeue {JOB_ID}") echo "$*" >> {tmp_path / "requeued"} ;;\n'
        '  *) echo "scontrol stand-in: $*" >&2; exit 1 ;;\n'
        "esac\n"
    )
    (bin_dir / "scontrol").chmod(0o755)
    env = {"SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NODELIST": "node1", "SLURM_SUBMIT_DIR": str(REPO)}
    return {**env, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def job_processes(run: Launch) -> list[psutil.Process]:
    """Every process of the job: the batch shell and its descendants (the supervisor starts deepspeed in a
    session of its own: a process group does not reach it; SLURM's cgroup does)."""
    root = psutil.Process(run.pid)
    return [root, *root.children(recursive=True)]


@pytest.mark.launcher
def test_a_duty_cycled_rank_is_named_and_the_slurm_job_saves_and_requeues(toy_data, rank_pool, tmp_path):
    """Rank 1 runs 20% of the time (SIGSTOP 40 ms, SIGCONT 10 ms) from step 5: rank 0 names it within a few
    windows of 2 steps. A second run on the same output folder stops at once with exit code 2, naming
    rank 0 as the holder, and writes nothing. Then SIGUSR1 to every process of the job; the moment the
    batch script returns, SIGKILL to whatever is left: the step in flight is saved, the script returned 75
    and asked for the requeue."""
    out = tmp_path / "slowed"
    sets = ["train.log_every_steps=2", "train.straggler_windows=2", "train.steps=2000"]
    args = fault_args(toy_data, out, *sets)[2:]  # CONFIG --set ...: the batch script's arguments
    run = Launch(2, args, tmp_path / "slowed.log", script=SBATCH, env=fake_slurm(tmp_path))
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
        second_run_refused(toy_data, out, run, rank_pool, tmp_path)
        processes = job_processes(run)
        signalled = time.monotonic()
        for proc in processes:
            proc.send_signal(signal.SIGUSR1)
        code = run.wait(timeout=120)
        returned = time.monotonic() - signalled
    finally:
        run.kill()
        for proc in job_processes(run) if run.proc.poll() is None else []:
            proc.kill()
    all_gone(processes, timeout=5)  # what the scheduler's SIGKILL would have found: nothing
    lines = straggler_lines(run.output())
    print(f"rank 1 duty-cycled: named {took:.1f} s after the cycle began: {lines[:1]}")
    print(f"SIGUSR1 to every process of the SLURM job: the batch script returned {code}, {returned:.1f} s on")
    assert lines, run.output()[-4000:]
    # (which part it names depends on where the stops fell: its forwards or its requests to its loader)
    assert "rank 1 on " in lines[0] and "rank 0 on " not in lines[0]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    named = [e for e in events.Scalars("perf/straggler_rank") if e.value == 1.0]
    ratios = {e.step: e.value for e in events.Scalars("perf/straggler_ratio")}
    assert named and max(ratios[e.step] for e in named) > 1.5

    assert code == PREEMPTED_EXIT_CODE, run.output()[-4000:]
    # the runner died of the SIGUSR1 (it has no handler for it): the supervisor read the ranks' 75
    assert "the runner ended with 138 (killed by signal SIGUSR1); the run itself with 75" in run.output()
    assert (tmp_path / "requeued").read_text().split() == ["requeue", JOB_ID]
    assert f"requeueing job {JOB_ID}" in run.output()
    saved = last_complete(out)
    assert SIGNAL_AFTER < saved < 2000 and len(step_log(out)) == saved


def second_run_refused(toy_data, out, first: Launch, rank_pool, tmp_path) -> None:
    """Another run on ``first``'s output folder (a job resubmitted while the old one trains, with another
    learning rate): exit code 2, one line naming rank 0's host and pid, and nothing of it in the folder."""
    before = sorted(p.name for p in out.rglob("*") if "tensorboard" in p.parts)
    args = fault_args(toy_data, out, "optim.lr=0.5", "train.hang_timeout_s=0")
    started = time.monotonic()
    output = run_ranks(2, [*MODULE, *args], tmp_path / "second.log", pool=rank_pool, expect=2)
    print(f"a second run on a live run's folder: refused {time.monotonic() - started:.1f} s after its start")
    holder = json.loads((out / "run.lock").read_text())
    assert holder["pid"] == first.rank(0).pid
    line = f"is held by a live run (host {holder['host']}, pid {holder['pid']}, since "
    assert line in output, output[-3000:]
    assert json.loads((out / "config.json").read_text())["optim"]["lr"] != 0.5
    assert sorted(p.name for p in out.rglob("*") if "tensorboard" in p.parts) == before


def test_a_clean_run_names_no_straggler(uninterrupted):
    """The uninterrupted run of 30 steps, windows of 5 steps, the default settings: no warning."""
    events = EventAccumulator(str(uninterrupted.out / "tensorboard"))
    events.Reload()
    ratios = [e.value for e in events.Scalars("perf/straggler_ratio")]
    print(f"clean run: straggler ratios per window {[round(r, 2) for r in ratios]}")
    assert len(ratios) == 6 and not straggler_lines(uninterrupted.output)
