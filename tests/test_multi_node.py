"""Two "nodes" through ``deepspeed --hostfile`` and pdsh (launchers/multi_node.sh): train, save, resume.

The nodes are this machine under two loopback addresses, 127.0.0.1 and 127.0.0.2, one rank each. The test
starts its own sshd on both (a free port, host and client keys it generates, nothing but loopback) and puts
an ``ssh`` first on PATH that uses an ssh config of its own: the stand-in for the ``~/.ssh/config`` of a
cluster user, which reaches both DeepSpeed's ssh check and pdsh, while the real ``~/.ssh`` is neither read
nor changed. The checkpoint of the two-node run is then resumed on one node with the same world size
(``launchers/single_node.sh`` with 2 ranks); another number of ranks is tests/test_resume.py's.

Two launches in all, shared by every test in this module. Skipped, saying why, where sshd or pdsh is
missing (``.ci/run`` installs them: Debian packages openssh-server and pdsh).
"""

import json
import os
import pwd
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launching import free_port
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from eva_fastclip.data import write_toy_dataset
from eva_fastclip.engine import checkpoint

pytestmark = pytest.mark.launcher

REPO = Path(__file__).parents[1]
HOSTS = ("127.0.0.1", "127.0.0.2")  # both loopback: two "nodes" that are this machine
FIRST_STEPS, TOTAL_STEPS = 4, 6


def find_tool(name: str) -> str | None:
    # sshd lives in /usr/sbin, which is not on every user's PATH
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(["/usr/sbin", "/sbin"]))


@pytest.fixture(scope="module")
def ssh(tmp_path_factory):
    """An sshd listening on both loopback addresses and a folder with an ``ssh`` that reaches it."""
    tools = {name: find_tool(name) for name in ("sshd", "ssh", "ssh-keygen", "pdsh")}
    missing = [name for name, path in tools.items() if path is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (Debian: apt-get install openssh-server pdsh)")
    if os.geteuid() == 0:
        # sshd started by root needs its privilege-separation directory, which the ssh service creates
        try:
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        except OSError as err:
            pytest.skip(f"sshd runs as root but /run/sshd cannot be created: {err}")
    tmp = tmp_path_factory.mktemp("ssh")
    for key in ("host_key", "client_key"):
        subprocess.run([tools["ssh-keygen"], "-q", "-t", "ed25519", "-N", "", "-f", tmp / key], check=True)
    shutil.copy(tmp / "client_key.pub", tmp / "authorized_keys")
    port = free_port()
    sshd_config = [
        f"Port {port}",
        *(f"ListenAddress {host}" for host in HOSTS),
        f"HostKey {tmp / 'host_key'}",
        f"AuthorizedKeysFile {tmp / 'authorized_keys'}",
        f"AllowUsers {pwd.getpwuid(os.geteuid()).pw_name}",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",
        "LogLevel VERBOSE",  # logs the address each login came to
    ]
    (tmp / "sshd_config").write_text("\n".join(sshd_config) + "\n")
    host_key = " ".join((tmp / "host_key.pub").read_text().split()[:2])
    (tmp / "known_hosts").write_text(",".join(f"[{host}]:{port}" for host in HOSTS) + f" {host_key}\n")
    ssh_config = [
        f"Port {port}",
        f"IdentityFile {tmp / 'client_key'}",
        "IdentitiesOnly yes",  # not the keys of the user's agent or ~/.ssh
        "BatchMode yes",  # fail instead of asking for anything
        f"UserKnownHostsFile {tmp / 'known_hosts'}",
        "StrictHostKeyChecking yes",
    ]
    (tmp / "ssh_config").write_text("\n".join(ssh_config) + "\n")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(
        f'#!/bin/sh\nexec {shlex.quote(tools["ssh"])} -F {shlex.quote(str(tmp / "ssh_config"))} "$@"\n'
    )
    (bin_dir / "ssh").chmod(0o755)
    log = tmp / "sshd.log"
    # sshd re-executes itself by the absolute path it was started with; -D: stay our child
    sshd = subprocess.Popen([tools["sshd"], "-D", "-f", tmp / "sshd_config", "-E", log])
    try:
        for host in HOSTS:
            for _ in range(120):  # sshd starts listening within a moment
                probe = [bin_dir / "ssh", host, "true"]
                if subprocess.run(probe, capture_output=True, timeout=30).returncode == 0:
                    break
                assert sshd.poll() is None, f"sshd exited:\n{log.read_text()}"
                time.sleep(0.25)
            else:
                pytest.fail(f"no ssh login to {host}:{port}:\n{log.read_text()}")
        yield {"bin": bin_dir, "log": log}
    finally:
        sshd.terminate()
        sshd.wait(timeout=30)


def launch(cmd: list, *, cwd: Path, env: dict[str, str], log: Path) -> str:
    """Run a launcher script; fail with its output if it fails."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.terminate()  # DeepSpeed's runner then stops the ranks on every host, through pdsh
        out, _ = proc.communicate(timeout=60)
    log.write_text(out)
    assert proc.returncode == 0, f"{Path(cmd[0]).name} failed:\n{out[-6000:]}"
    return out


def logged_steps(run_dir: Path) -> list[int]:
    steps = []
    for events in sorted((run_dir / "tensorboard").glob("events.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        steps += [e.step for e in acc.Scalars("train/loss")]
    return steps


@pytest.fixture(scope="module")
def runs(ssh, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multi_node")
    write_toy_dataset(
        tmp / "toy", num_train=256, num_val=1, num_zeroshot=1, image_size=32, samples_per_shard=64, seed=0
    )
    out = tmp / "run"
    # every value in the config file: on the way through pdsh the remote shell would strip the quotes of
    # a --set with a JSON list of strings (docs/launching.md)
    config = json.loads((REPO / "configs" / "toy.json").read_text())
    config["model"]["name"] = "test-vit-xs"
    config["data"]["train_shards"] = [str(tmp / "toy" / "train")]
    config["eval"] = {"zeroshot_dir": None, "retrieval_shards": None}
    config["train"].update(
        deepspeed_config=str(REPO / "ds_configs" / "zero1_lamb.json"),
        batch_size=8,
        output_dir=str(out),
        log_every_steps=1,
        keep_checkpoints=2,
    )
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "hostfile").write_text("".join(f"{host} slots=1\n" for host in HOSTS))
    work = tmp / "work"  # the launch directory: multi_node.sh writes .deepspeed_env here, not in the checkout
    work.mkdir()

    venv_bin = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSH_")}
    env.update(
        PATH=os.pathsep.join([str(ssh["bin"]), str(venv_bin), os.environ["PATH"]]),
        PYTHONUNBUFFERED="1",
        HOSTFILE=str(tmp / "hostfile"),
        MASTER_ADDR=HOSTS[0],
        MASTER_PORT=str(free_port()),
    )
    sshd_log_start = ssh["log"].stat().st_size
    two_nodes = launch(
        [REPO / "launchers" / "multi_node.sh", tmp / "config.json", "--set", f"train.steps={FIRST_STEPS}"],
        cwd=work,
        env=env,
        log=tmp / "two_nodes.log",
    )
    logins = ssh["log"].read_text()[sshd_log_start:]
    one_node = launch(
        [
            REPO / "launchers" / "single_node.sh",
            tmp / "config.json",
            "--set",
            f"train.steps={TOTAL_STEPS}",
            "--resume",
            "latest",
        ],
        cwd=work,
        env={**env, "NUM_GPUS": "2", "MASTER_PORT": str(free_port())},
        log=tmp / "one_node.log",
    )
    return {"out": out, "work": work, "env": env, "logs": (two_nodes, one_node), "logins": logins}


def test_hostfile_launch_runs_one_rank_on_each_host(runs):
    two_nodes = runs["logs"][0]
    # pdsh prefixes every line with the host it came from; DeepSpeed's launcher there names its node rank
    for node_rank, host in enumerate(HOSTS):
        assert f"{host}: " in two_nodes
        assert any(
            line.startswith(f"{host}: ") and f"nnodes=2, num_local_procs=1, node_rank={node_rank}" in line
            for line in two_nodes.splitlines()
        ), f"no launcher of node rank {node_rank} on {host}"
    # sshd saw logins to both addresses during the launch (not just the test's own probes before it)
    for host in HOSTS:
        assert f" on {host} port " in runs["logins"]
    # PATH reached the remote ranks through .deepspeed_env in the launch directory, with the venv first
    # after the test's ssh
    path = runs["env"]["PATH"]
    assert (runs["work"] / ".deepspeed_env").read_text().splitlines() == [f"PATH={path}"]
    assert f"export PATH={path};" in two_nodes or f'export PATH="{path}";' in two_nodes  # quoted if need be


def test_two_node_checkpoint_is_complete(runs):
    folder = runs["out"] / "checkpoints" / checkpoint.tag_for_step(FIRST_STEPS)
    marker = json.loads((folder / checkpoint.MARKER).read_text())
    assert {key: marker[key] for key in ("step", "tag", "world_size")} == {
        "step": FIRST_STEPS,
        "tag": folder.name,
        "world_size": 2,
    }
    # each node's rank wrote its own ZeRO partition into the shared output folder
    for rank in range(2):
        assert len(list(folder.glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))) == 1
    assert (folder / "mp_rank_00_model_states.pt").is_file()


def test_resume_on_one_node_continues_from_the_saved_step(runs):
    one_node = runs["logs"][1]
    first = runs["out"] / "checkpoints" / checkpoint.tag_for_step(FIRST_STEPS)
    assert f"resumed from {first} at step {FIRST_STEPS}" in one_node
    assert "dist_world_size=2" in one_node
    assert not any(line.startswith(HOSTS) for line in one_node.splitlines())  # no pdsh: one node
    kept = [p.name for p in checkpoint.complete_checkpoints(runs["out"] / "checkpoints")]
    assert kept == [checkpoint.tag_for_step(FIRST_STEPS), checkpoint.tag_for_step(TOTAL_STEPS)]
    # the first run logged steps 1..4, the resumed one 5..6: nothing twice, nothing missing
    assert sorted(logged_steps(runs["out"])) == list(range(1, TOTAL_STEPS + 1))
