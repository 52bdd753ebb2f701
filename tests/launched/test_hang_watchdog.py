"""No silent hang (reliability/watchdog.py), with real processes and real signals: a rank whose phase outlasts
its allowance logs what it was doing, which ranks it waits for and its threads' stacks, and exits with
code 124; the launcher then ends the rest, and no process of the run is left. Each test prints how long
the detection and the whole stop took.

The runs are launched/fault_runs.py's. The stalled loader worker's goes through the real launcher: launch.py
ending the other ranks is part of what is tested there. The stopped rank's comes from the rank pool, whose
supervisor does launch.py's part (SIGTERM to the other ranks' trees, SIGKILL 30 s later).
"""

import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
from fault_runs import MODULE, fault_args
from launching import Launch, all_gone, wait_for_step

from eva_fastclip.reliability.guardian import PROCESS_NAME
from eva_fastclip.reliability.watchdog import HANG_EXIT_CODE

TIMEOUT = 8


def test_a_phase_that_outlasts_its_allowance_ends_the_process():
    """Without a process group: the stacks of every thread, the phase, and exit code 124."""
    program = (
        "import time\n"
        "from eva_fastclip.reliability.watchdog import Watchdog\n"
        "with Watchdog(1.0, 2.0) as dog:\n"
        "    dog.set_phase('loader', step=3)\n"
        "    time.sleep(30)\n"
    )
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    print(f"the watchdog ended the process {took:.1f} s after it started (allowance 1 s)")
    assert result.returncode == HANG_EXIT_CODE
    # the watchdog polls: on a loaded machine it may see the stall a second late, never early
    fired = re.search(r"no progress for (\d+) s in phase 'loader' at step 4 \(allowance 1 s\)", result.stderr)
    assert fired and int(fired.group(1)) >= 1, result.stderr
    assert 'File "<string>", line 5 in <module>' in result.stderr  # the main thread's stack: the sleep
    assert took < 10


def hanging_args(data, tmp_path, *extra) -> list[str]:
    sets = [f"train.hang_timeout_s={TIMEOUT}", "train.hang_timeout_long_s=120", "train.steps=2000", *extra]
    return [*MODULE, *fault_args(data, tmp_path / "run", *sets)]


def test_a_stopped_rank_is_named_and_the_run_ends(toy_data, rank_pool, tmp_path):
    """SIGSTOP to rank 1 (a wedged GPU, a stuck file system): rank 0 waits in a collective, its watchdog
    names rank 1 (no heartbeat) and exits 124; the supervisor ends rank 1 (SIGTERM, then SIGKILL after
    30 s, as launch.py does). (No loader workers: the next test stops those.)"""
    run = rank_pool.launch(2, hanging_args(toy_data, tmp_path, "data.workers=0"), tmp_path / "stopped.log")
    try:
        wait_for_step(tmp_path / "run", 5, alive=lambda: run.poll() is None, log=run.log)
        processes = run.processes()
        stopped = time.monotonic()
        run.rank(1).send_signal(signal.SIGSTOP)
        code = run.wait(timeout=TIMEOUT + 120)
        detected = next(
            (line for line in run.output().splitlines() if "no progress for" in line),
            f"none:\n{run.output()[-3000:]}",
        )
        gone = all_gone(processes, timeout=60) + time.monotonic() - stopped
    finally:
        run.kill()
    print(f"rank 1 stopped: the run ended with {code}, every process gone {gone:.1f} s later; {detected}")
    assert code == HANG_EXIT_CODE, run.output()[-4000:]
    assert "rank 0 (" in detected and "waiting for ranks no heartbeat in " in detected
    assert "rank 1 (" in detected.split("waiting for ranks", 1)[1]
    assert "Thread 0x" in run.output()  # the stacks
    assert gone < TIMEOUT + 30 + 30  # the allowance, launch.py's 30 s before its SIGKILL, and start-up slack


def name_of(process: psutil.Process) -> str | None:
    """The process's name; None once it has ended (listed a moment before)."""
    try:
        return None if process.status() == psutil.STATUS_ZOMBIE else process.name()
    except psutil.NoSuchProcess:
        return None


@pytest.mark.launcher
def test_a_stalled_loader_worker_is_named_and_the_run_ends(toy_data, tmp_path):
    """SIGSTOP to a loader worker of rank 0: rank 0 waits for a batch past its allowance and names its
    workers; rank 1 waits in a collective and names rank 0 as behind; both exit 124, the stopped worker
    is killed with its rank, and nothing of the run is left."""
    run = Launch(2, hanging_args(toy_data, tmp_path), tmp_path / "stalled_worker.log")
    try:
        # mid-epoch (4 steps an epoch): the last epoch's workers have ended, none of the next has started
        run.wait_for_step(6)
        processes = run.processes()
        rank0 = run.rank(0)
        # its fork server's children (data/workers.py) but its guardian (reliability/guardian.py)
        forked = [process for child in rank0.children() for process in child.children()]
        workers = [worker for worker in forked if name_of(worker) not in (PROCESS_NAME, None)]
        assert workers, "rank 0 has no loader workers"
        stopped = time.monotonic()
        for worker in workers:
            worker.send_signal(signal.SIGSTOP)
        code = run.wait(timeout=TIMEOUT + 120)
        gone = all_gone(processes, timeout=60) + time.monotonic() - stopped
    finally:
        run.kill()
    lines = [line for line in run.output().splitlines() if "no progress for" in line]
    print(
        f"rank 0's loader workers stopped: the run ended with {code}, every process gone {gone:.1f} s later"
    )
    assert code == HANG_EXIT_CODE, run.output()[-4000:]
    (stalled,) = [line for line in lines if "in phase 'loader'" in line]
    assert stalled.split("ERROR eva_fastclip.reliability.watchdog: ")[1].startswith("rank 0 (")
    assert all(str(worker.pid) in stalled for worker in workers)  # its workers named
    # rank 1 names rank 0: waiting for a batch, or (gone first, taking the store it serves) stopped or gone
    waiting = [line for line in lines if "in phase 'loader'" not in line]
    named = (
        "in another phase: rank 0 (",
        "behind, at an earlier step: rank 0 (",
        "rank 0 is stopped or gone",
        "(stopped or gone): rank 0 (",  # its count stopped while rank 1 watched: it had exited
    )
    assert all(any(text in line for text in named) for line in waiting), waiting
