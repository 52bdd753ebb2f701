"""The restart supervisor (eva_fastclip/reliability/restarts.py) around a stand-in for the ``deepspeed``
command: a script that records its arguments and exits with the codes it is given, one per run. The real runs,
with a node lost, are tests/test_multi_node.py's."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eva_fastclip.reliability.restarts import cause, with_option

REPO = Path(__file__).parents[1]


def stand_in(tmp_path: Path, codes: list[int], sleep: float = 0.0) -> list[str]:
    """A command that appends its arguments to calls.jsonl and exits with the next of ``codes``."""
    script = tmp_path / "stand_in.py"
    script.write_text(
        "import json, sys, time\n"
        f"calls = {str(tmp_path / 'calls.jsonl')!r}\n"
        "with open(calls, 'a') as f: f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"codes = {codes!r}\n"
        "n = sum(1 for _ in open(calls))\n"
        f"time.sleep({sleep})\n"
        "sys.exit(codes[min(n, len(codes)) - 1])\n"
    )
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"train": {"output_dir": str(tmp_path / "run")}}))
    return [sys.executable, str(script), "--module", "eva_fastclip", "train", "--config", str(config)]


def supervise(command: list[str], max_restarts: int, **kwargs) -> subprocess.CompletedProcess:
    args = [
        sys.executable,
        "-m",
        "eva_fastclip.reliability.restarts",
        "--max-restarts",
        str(max_restarts),
        "--",
        *command,
    ]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=REPO, **kwargs)


def calls(tmp_path: Path) -> list[list[str]]:
    return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]


def test_a_failed_run_is_rerun_with_resume_latest_until_it_succeeds(tmp_path):
    result = supervise(stand_in(tmp_path, [124, 1, 0]), max_restarts=3)
    assert result.returncode == 0, result.stderr
    first, *again = calls(tmp_path)
    assert "--resume" not in first and all(call[-2:] == ["--resume", "latest"] for call in again)
    assert len(again) == 2
    lines = [line for line in result.stderr.splitlines() if "restart " in line]
    assert "restart 1 of 3: the run exited with code 124 (a hang (a rank's watchdog))" in lines[0]
    assert "restart 2 of 3: the run exited with code 1 (a rank failed)" in lines[1]
    assert "resuming from step 0 (no complete checkpoint yet)" in lines[0]


def test_restarts_stop_at_max_restarts(tmp_path):
    result = supervise(stand_in(tmp_path, [1]), max_restarts=2)
    assert result.returncode == 1 and len(calls(tmp_path)) == 3
    assert "after 2 restart(s): no more" in result.stderr


@pytest.mark.parametrize("code", [2, 3, 4, 75])
def test_what_a_restart_cannot_cure_and_a_preemption_are_not_restarted(tmp_path, code):
    result = supervise(stand_in(tmp_path, [code, 0]), max_restarts=3)
    assert result.returncode == code and len(calls(tmp_path)) == 1
    assert f"the run exited with code {code}: " in result.stderr and "not restarted" in result.stderr


def test_sigterm_to_the_supervisor_reaches_the_run_and_nothing_restarts(tmp_path):
    args = [sys.executable, "-m", "eva_fastclip.reliability.restarts", "--max-restarts", "3", "--"]
    proc = subprocess.Popen(
        [*args, *stand_in(tmp_path, [0], sleep=30)], cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    while not (tmp_path / "calls.jsonl").exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM and len(calls(tmp_path)) == 1
    assert "a stop was asked for; not restarted" in err


def test_options_and_causes():
    assert with_option(["ds", "--hostfile", "a", "x"], "--hostfile", "b") == ["ds", "--hostfile", "b", "x"]
    assert with_option(["ds", "--master_addr=h1"], "--master_addr", "h2") == ["ds", "--master_addr=h2"]
    assert with_option(["ds", "train"], "--resume", "latest") == ["ds", "train", "--resume", "latest"]
    assert cause(-9) == "killed by signal SIGKILL" and cause(137) == "killed by signal SIGKILL"
    assert cause(255) == "a node lost (ssh ended)"


def test_the_launchers_refuse_a_bad_max_restarts(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}  # (an in-process run's, maybe)
    env.update(MAX_RESTARTS="two", NUM_GPUS="1")
    result = subprocess.run(
        [REPO / "launchers" / "single_node.sh", "configs/toy.json"], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "MAX_RESTARTS=two and MIN_NODES=1 must be whole numbers" in result.stderr
