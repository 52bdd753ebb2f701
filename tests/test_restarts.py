"""The launch supervisor's restarts (eva_fastclip/reliability/supervisor.py, restarts.py) around a
stand-in for the ``deepspeed`` command (tests/restart_stand_in.py), run in this process through its
``main``: what is rerun with ``--resume latest``, what is not, and the lines it logs. A SIGTERM to the
supervisor's own process is tests/launched/test_restarts_sigterm.py's; the real runs, with a node lost,
tests/launched/test_multi_node.py's."""

import pytest
from restart_stand_in import calls, stand_in

from eva_fastclip.reliability import supervisor
from eva_fastclip.reliability.restarts import cause, with_option


def supervise(command: list[str], max_restarts: int, capfd) -> tuple[int, str]:
    """``python -m eva_fastclip.reliability.supervisor --max-restarts N -- COMMAND``: its exit code and what
    it wrote to stderr."""
    capfd.readouterr()
    code = supervisor.main(["--max-restarts", str(max_restarts), "--", *command])
    return code, capfd.readouterr().err


def test_a_failed_run_is_rerun_with_resume_latest_until_it_succeeds(tmp_path, capfd):
    code, stderr = supervise(stand_in(tmp_path, [124, 1, 0]), 3, capfd)
    assert code == 0, stderr
    first, *again = calls(tmp_path)
    assert "--resume" not in first and all(call[-2:] == ["--resume", "latest"] for call in again)
    assert len(again) == 2
    lines = [line for line in stderr.splitlines() if "restart " in line]
    assert "restart 1 of 3: the run exited with code 124 (a hang (a rank's watchdog))" in lines[0]
    assert "restart 2 of 3: the run exited with code 1 (a rank failed)" in lines[1]
    assert "resuming from step 0 (no complete checkpoint yet)" in lines[0]


def test_restarts_stop_at_max_restarts(tmp_path, capfd):
    code, stderr = supervise(stand_in(tmp_path, [1]), 2, capfd)
    assert code == 1 and len(calls(tmp_path)) == 3
    assert "after 2 restart(s): no more" in stderr


@pytest.mark.parametrize("code", [2, 3, 4, 75])
def test_what_a_restart_cannot_cure_and_a_preemption_are_not_restarted(tmp_path, capfd, code):
    returned, stderr = supervise(stand_in(tmp_path, [code, 0]), 3, capfd)
    assert returned == code and len(calls(tmp_path)) == 1
    assert f"the run exited with code {code}: " in stderr and "not restarted" in stderr


def test_options_and_causes():
    assert with_option(["ds", "--hostfile", "a", "x"], "--hostfile", "b") == ["ds", "--hostfile", "b", "x"]
    assert with_option(["ds", "--master_addr=h1"], "--master_addr", "h2") == ["ds", "--master_addr=h2"]
    assert with_option(["ds", "train"], "--resume", "latest") == ["ds", "train", "--resume", "latest"]
    assert cause(-9) == "killed by signal SIGKILL" and cause(137) == "killed by signal SIGKILL"
    assert cause(255) == "a node lost (ssh ended)"
