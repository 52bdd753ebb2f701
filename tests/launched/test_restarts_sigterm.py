"""A SIGTERM to the launch supervisor's own process (``python -m eva_fastclip.reliability.supervisor``)
reaches the run, and nothing is restarted. The supervisor's other decisions: tests/test_restarts.py."""

import signal
import subprocess
import sys
import time
from pathlib import Path

from restart_stand_in import calls, stand_in

REPO = Path(__file__).parents[2]


def test_sigterm_to_the_supervisor_reaches_the_run_and_nothing_restarts(tmp_path):
    args = [sys.executable, "-m", "eva_fastclip.reliability.supervisor", "--max-restarts", "3", "--"]
    proc = subprocess.Popen(
        [*args, *stand_in(tmp_path, [0], sleep=30)], cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    while not (tmp_path / "calls.jsonl").exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM and len(calls(tmp_path)) == 1
    assert "a stop was asked for; not restarted" in err
