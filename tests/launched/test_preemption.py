"""Preemption with real processes and real signals (reliability/preemption.py, reliability/supervisor.py):
a signal to one rank or to every rank makes every rank save the checkpoint of the step in flight and exit
with code 75; a scheduler's SIGTERM to the command it runs (the launch supervisor, PID 1 of a container),
followed by SIGKILL to everything the moment it returns, leaves that step saved and the command's 75, and
the run resumes from it exactly; a second signal stops at once, the last complete checkpoint intact. Each
test prints how long the stop took. (SLURM's signals, to the batch shell and to every process of the job,
end test_straggler_runs's slowed run through launchers/slurm.sbatch.)

The signalled runs are launched/fault_runs.py's (2 ranks, tiny model, fp32 on CPU, 2 loader workers a
rank, which ignore the signals: the step in flight finishes). The scheduler's SIGTERM goes through the
real launcher chain (single_node.sh, the supervisor, ``deepspeed``, launch.py). The other signalled runs,
the uninterrupted run they are compared with (launched/conftest.py) and the resumed run come from the rank
pool, whose supervisor does launch.py's part: their launcher is not under test.
"""

import json
import signal
import subprocess
import time

import psutil
import pytest
import torch
from fault_runs import MODULE, SIGNAL_AFTER, STEPS, fault_args, last_complete, step_log
from launching import REPO, Launch, all_gone, cmdline, run_ranks, wait_for_step

from eva_fastclip.checkpointing import checkpoint
from eva_fastclip.export import consolidated_state_dict
from eva_fastclip.reliability.preemption import PREEMPTED_EXIT_CODE
from eva_fastclip.reliability.run_lock import read_exit, read_holder

SINGLE_NODE = REPO / "launchers" / "single_node.sh"


@pytest.mark.launcher
def test_the_scheduler_sigterm_then_sigkill_leaves_the_step_in_flight_saved_and_resumes_exactly(
    toy_data, uninterrupted, rank_pool, tmp_path
):
    """Kubernetes' stop, as it happens: launchers/single_node.sh as PID 1 of a PID namespace of its own
    (it execs the launch supervisor; where no namespace can be made, the supervisor is signalled as a job
    script's main process), SIGTERM to that process alone, and SIGKILL to everything left of the job the
    moment it returns (a PID namespace's processes die with its PID 1 anyway). It returns 75 only after
    both ranks saved the step in flight; --resume latest then ends where the uninterrupted run does (every
    step's logged metrics, the final weights and the per-sample table)."""
    out = tmp_path / "run"
    args = fault_args(toy_data, out, "train.log_every_steps=5")  # as the uninterrupted run logs
    namespace = pid_namespace()
    run = Launch(2, args[2:], tmp_path / "pid1.log", script=SINGLE_NODE, prefix=namespace)
    try:
        run.wait_for_step(SIGNAL_AFTER)
        supervisor = psutil.Process(run.pid).children()[0] if namespace else psutil.Process(run.pid)
        assert "eva_fastclip.reliability.supervisor" in cmdline(supervisor)
        signalled = time.monotonic()
        supervisor.send_signal(signal.SIGTERM)
        code = run.wait()
        returned = time.monotonic() - signalled
    finally:
        run.kill()  # the scheduler's SIGKILL to the rest, the moment the command returned
    where = "PID 1 of a PID namespace" if namespace else "the job's main process (no PID namespace here)"
    print(f"SIGTERM to the launch supervisor as {where}: it returned {code} {returned:.1f} s later")
    assert code == PREEMPTED_EXIT_CODE, run.output()[-4000:]
    saved = last_complete(out)
    assert SIGNAL_AFTER < saved < STEPS and len(step_log(out)) == saved, run.output()[-4000:]
    assert json.loads((out / "run_exit.json").read_text())["code"] == PREEMPTED_EXIT_CODE
    assert not (out / "run.lock").exists()

    again = [*MODULE, *args, "--set", "train.hang_timeout_s=0", "--resume", "latest"]
    resumed = run_ranks(2, again, tmp_path / "resumed.log", pool=rank_pool)
    assert f"resumed from {out / 'checkpoints' / checkpoint.tag_for_step(saved)}" in resumed
    reference = uninterrupted.out
    assert step_log(out) == step_log(reference)  # the same losses, metrics and lrs, step by step
    final = checkpoint.tag_for_step(STEPS)
    want = consolidated_state_dict(reference / "checkpoints" / final)
    got = consolidated_state_dict(out / "checkpoints" / final)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=0, msg=name)
    for path in (reference / "checkpoints" / final / "per_sample").iterdir():
        other = out / "checkpoints" / final / "per_sample" / path.name
        torch.testing.assert_close(torch.load(other)["values"], torch.load(path)["values"], rtol=1e-6, atol=0)


def pid_namespace() -> list[str]:
    """``unshare`` making a PID namespace whose PID 1 is the command, where this machine allows it."""
    command = ["unshare", "--pid", "--fork", "--mount-proc"]
    try:
        ok = subprocess.run([*command, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return command if ok else []


def test_the_preempt_signal_to_one_rank(toy_data, rank_pool, tmp_path):
    """train.preempt_signal=SIGUSR1 (SLURM's --signal=USR1@...) to rank 1 alone: both ranks agree at the
    next step boundary, save that step together and exit 75 (rank 0 says another rank was asked). The run
    also saves every 0.3 s (train.save_every_minutes): rank 0's clock decides, and both ranks save at the
    same steps (a save is a collective: ranks that disagreed would wait for each other for good). (Every
    rank signalled at once: the launch supervisor's stops, test_the_scheduler_... and
    test_straggler_runs.py.)"""
    out = tmp_path / "run"
    sets = ["train.preempt_signal=SIGUSR1", "train.save_every_minutes=0.005", "train.keep_checkpoints=100"]
    run = rank_pool.launch(2, [*MODULE, *fault_args(toy_data, out, *sets)], tmp_path / "usr1.log")
    try:
        wait_for_step(out, SIGNAL_AFTER, alive=lambda: run.poll() is None, log=run.log)
        processes = run.processes()
        signalled = time.monotonic()
        run.rank(1).send_signal(signal.SIGUSR1)
        code = run.wait(120)
        gone = all_gone(processes, timeout=30) + time.monotonic() - signalled
    finally:
        run.kill()
    print(f"SIGUSR1 to rank 1: every process of the run gone {gone:.1f} s after the signal")
    assert code == PREEMPTED_EXIT_CODE, run.output()[-4000:]
    saved = last_complete(out)
    assert SIGNAL_AFTER < saved < STEPS and len(step_log(out)) == saved
    assert f"eva-fastclip train: preempted: step {saved}: another rank was asked to stop" in run.output()
    assert len(checkpoint.complete_checkpoints(out / "checkpoints")) > 2  # saved by time before the stop


def test_a_second_signal_stops_at_once_with_the_last_checkpoint_intact(toy_data, rank_pool, tmp_path):
    """Rank 1 stopped (SIGSTOP), so rank 0 cannot reach the step boundary: SIGTERM asks rank 0 to stop,
    and a second SIGTERM 3 s later ends it at once although it waits inside a collective; the last
    complete checkpoint (scheduled, step 4) stays the one to resume. Rank 0 records that exit (75) and
    gives the folder up first: on several nodes the launch supervisor has only that record to return."""
    out = tmp_path / "run"
    args = fault_args(toy_data, out, "train.save_every_steps=4")
    # rank 1, let go after rank 0 is gone, may wait in a collective or for its step boundary: the supervisor
    # SIGKILLs it 5 s after its SIGTERM rather than launch.py's 30 (which launcher ends it is not under test)
    run = rank_pool.launch(2, [*MODULE, *args], tmp_path / "second.log", grace_s=5.0)
    try:
        wait_for_step(out, 6, alive=lambda: run.poll() is None, log=run.log)
        processes = run.processes()
        rank0, rank1 = run.rank(0), run.rank(1)
        rank1.suspend()
        try:
            time.sleep(1.0)  # rank 0 is in a collective with rank 1 by now
            rank0.send_signal(signal.SIGTERM)
            time.sleep(3.0)
            assert rank0.is_running() and rank0.status() != psutil.STATUS_ZOMBIE  # the first one waits
            signalled = time.monotonic()
            rank0.send_signal(signal.SIGTERM)
            rank0.wait(timeout=10)  # (not its child: no exit code here; the supervisor passes it on)
            print(f"second SIGTERM: rank 0 gone {time.monotonic() - signalled:.2f} s after it")
        finally:
            rank1.resume()
        assert run.wait(120) == PREEMPTED_EXIT_CODE, run.output()[-4000:]
        all_gone(processes, timeout=60)
    finally:
        run.kill()
    assert last_complete(out) == 4
    assert checkpoint.resolve_resume("latest", out / "checkpoints").name == checkpoint.tag_for_step(4)
    assert "SIGTERM again: stopping now; the last complete checkpoint is intact" in run.output()
    record = read_exit(out)
    assert record["code"] == PREEMPTED_EXIT_CODE and "SIGTERM again: stopping now" in record["detail"], record
    assert read_holder(out) is None  # the lock given up
