"""The launch supervisor's restarts (eva_fastclip/reliability/supervisor.py, restarts.py) around a
stand-in for the ``deepspeed`` command (tests/restart_stand_in.py), run in this process through its
``main``: what is rerun with ``--resume latest``, what is not, and the lines it logs. A SIGTERM to the
supervisor's own process is tests/launched/test_restarts_sigterm.py's; the real runs, with a node lost,
tests/launched/test_multi_node.py's."""

import os

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


def test_the_runs_output_folder_is_read_from_set_either_way(tmp_path):
    """argparse takes ``--set K=V`` and ``--set=K=V``: the supervisor reads the folder the run writes in
    either way (it watched the config's default folder before, refusing or misreading the exit)."""
    from eva_fastclip.reliability.restarts import train_config

    base = [
        "deepspeed",
        "--num_gpus",
        "2",
        "--module",
        "eva_fastclip",
        "train",
        "--config",
        "configs/toy.json",
    ]
    for sets in (
        ["--set", f"train.output_dir={tmp_path / 'a'}"],
        [f"--set=train.output_dir={tmp_path / 'a'}"],
    ):
        assert train_config([*base, *sets]).train.output_dir == str(tmp_path / "a")
    later = [f"--set=train.output_dir={tmp_path / 'a'}", "--set", f"train.output_dir={tmp_path / 'b'}"]
    assert train_config([*base, *later]).train.output_dir == str(tmp_path / "b")  # the last one wins


def test_a_lost_master_is_recognised_by_its_address_too(tmp_path, monkeypatch):
    """``MASTER_ADDR=10.0.0.1`` with the hostfile naming the node: losing the node moves rank 0, as losing
    ``--master_addr node-a`` does."""
    import socket

    from eva_fastclip.reliability import restarts

    real = socket.getaddrinfo
    names = {"node-a": "127.0.0.5", "node-b": "127.0.0.6"}  # the cluster's DNS, for these names only

    def resolve(host, *args, **kwargs):
        return real(names.get(host, host), *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert restarts.is_lost("127.0.0.5", ["node-a"]) and restarts.is_lost("node-a", ["node-a"])
    assert not restarts.is_lost("127.0.0.5", ["node-b"])
    assert not restarts.is_lost("10.9.9.9", ["a-name-no-longer-resolving.invalid"])


def test_the_ssh_probe_takes_the_runs_ssh_port_and_pdsh_options(tmp_path, monkeypatch):
    """The probe asks with the port and the options the run's own ssh uses (DeepSpeed's ``--ssh_port``,
    pdsh's ``PDSH_SSH_ARGS_APPEND``): a host reachable on port 2222 only is not reported lost."""
    from eva_fastclip.reliability import restarts

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(
        f'#!/usr/bin/env bash\necho "$@" >> {tmp_path / "calls"}\n[[ " $* " == *" -p 2222 "* ]]\n'
    )
    (bin_dir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", "-o StrictHostKeyChecking=no -i /keys/run")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=8\nnode-b slots=8\n")
    command = [
        "deepspeed",
        "--hostfile",
        str(hostfile),
        "--ssh_port",
        "2222",
        "--module",
        "eva_fastclip",
        "train",
    ]
    assert restarts.surviving_nodes(command, min_nodes=2) == command  # both answer: nothing changes
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0].endswith("-o StrictHostKeyChecking=no -i /keys/run -p 2222 node-a true")
    assert restarts.ssh_options(["deepspeed", "--ssh_port=2200"])[-2:] == ["-p", "2200"]
