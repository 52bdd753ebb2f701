"""Two "nodes" through ``deepspeed --hostfile`` and pdsh (launchers/multi_node.sh): train, save, resume,
and the faults a multi-node run survives.

The nodes are this machine under two loopback addresses, 127.0.0.1 and 127.0.0.2, one rank each. The test
starts its own sshd on both (a free port, host and client keys it generates, nothing but loopback) and puts
an ``ssh`` first on PATH that uses an ssh config of its own: the stand-in for the ``~/.ssh/config`` of a
cluster user, which reaches both DeepSpeed's ssh check and pdsh, while the real ``~/.ssh`` is neither read
nor changed. A SLURM job on both (launchers/slurm.sbatch, with SLURM's environment and a stand-in
``scontrol``) stopped as ``--signal=B:USR1`` stops it is then resumed on one node with the same world size
(2 ranks of the rank pool; ``launchers/single_node.sh``'s command line is tests/launched/test_launchers.py's)
and compared with an uninterrupted run; another number of ranks is tests/launched/test_resume_runs.py's.
Those launches serve five tests; a rank killed on node 2 and the loss of that node at the restart share a
run; a stopped rank has one of its own.

Skipped, saying why, where sshd or pdsh is missing (``.ci/run`` installs them: Debian packages
openssh-server and pdsh).
"""

import contextlib
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from fault_runs import step_log
from launching import REPO, cmdline, free_port, kill_tree, run_ranks, still_running
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from eva_fastclip.checkpointing import checkpoint
from eva_fastclip.data import write_toy_dataset
from eva_fastclip.export import consolidated_state_dict
from eva_fastclip.reliability.run_lock import read_exit

pytestmark = pytest.mark.launcher

HOSTS = ("127.0.0.1", "127.0.0.2")  # both loopback: two "nodes" that are this machine


def find_tool(name: str) -> str | None:
    # sshd lives in /usr/sbin, which is not on every user's PATH
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(["/usr/sbin", "/sbin"]))


@pytest.fixture(scope="module")
def ssh(tmp_path_factory):
    """An sshd on each loopback address (one a "node") and a folder with an ``ssh`` that reaches them."""
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
    common = [
        f"Port {port}",
        f"HostKey {tmp / 'host_key'}",
        f"AuthorizedKeysFile {tmp / 'authorized_keys'}",
        f"AllowUsers {pwd.getpwuid(os.geteuid()).pw_name}",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",
        "LogLevel VERBOSE",  # logs the address each login came to
    ]
    for i, host in enumerate(HOSTS):  # an sshd a "node", so that one node's can be stopped
        (tmp / f"sshd_config_{i}").write_text("\n".join([*common, f"ListenAddress {host}"]) + "\n")
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
    log = tmp / "sshd.log"  # both append to it
    sshd: dict[str, subprocess.Popen] = {}

    def start(host: str) -> None:
        # sshd re-executes itself by the absolute path it was started with; -D: stay our child
        config = tmp / f"sshd_config_{HOSTS.index(host)}"
        sshd[host] = subprocess.Popen([tools["sshd"], "-D", "-f", config, "-E", log])
        for _ in range(120):  # sshd starts listening within a moment
            probe = [bin_dir / "ssh", host, "true"]
            if subprocess.run(probe, capture_output=True, timeout=30).returncode == 0:
                return
            assert sshd[host].poll() is None, f"sshd exited:\n{log.read_text()}"
            time.sleep(0.25)
        pytest.fail(f"no ssh login to {host}:{port}:\n{log.read_text()}")

    try:
        for host in HOSTS:
            start(host)
        yield {"bin": bin_dir, "log": log, "sshd": sshd, "start": start}
    finally:
        for server in sshd.values():
            server.terminate()
            server.wait(timeout=30)


def logged_steps(run_dir: Path) -> list[int]:
    steps = []
    for events in sorted((run_dir / "tensorboard").glob("events.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        steps += [e.step for e in acc.Scalars("train/loss")]
    return steps


def two_node_run(ssh, tmp: Path, **train) -> dict[str, str]:
    """Toy shards, ``tmp/config.json`` (the toy config with ``train``'s values) and a hostfile of both
    "nodes" under ``tmp``; the launchers' environment. Every value is in the config file: on the way
    through pdsh the remote shell would strip the quotes of a --set with a JSON list of strings
    (docs/launching.md)."""
    write_toy_dataset(
        tmp / "toy", num_train=256, num_val=1, num_zeroshot=1, image_size=32, samples_per_shard=64, seed=0
    )
    config = json.loads((REPO / "configs" / "toy.json").read_text())
    config["model"]["name"] = "test-vit-xs"
    config["data"]["train_shards"] = [str(tmp / "toy" / "train")]
    config["eval"] = {"zeroshot_dir": None, "retrieval_shards": None}
    config["train"].update(
        deepspeed_config=str(REPO / "ds_configs" / "zero1_lamb.json"),
        batch_size=8,
        log_every_steps=1,
        precision="fp32",  # on every CPU kind: auto would be bf16 where the CPU computes it
        **train,
    )
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "hostfile").write_text("".join(f"{host} slots=1\n" for host in HOSTS))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSH_")}
    env.update(
        PATH=os.pathsep.join([str(ssh["bin"]), str(Path(sys.executable).parent), os.environ["PATH"]]),
        PYTHONUNBUFFERED="1",
        HOSTFILE=str(tmp / "hostfile"),
        MASTER_ADDR=HOSTS[0],
        MASTER_PORT=str(free_port()),
    )
    return env


JOB_ID = "4243"


def fake_slurm(tmp: Path, path: str) -> dict[str, str]:
    """SLURM's batch environment on an allocation of both "nodes" (the submit folder ``tmp``), and ``path``
    after a folder whose ``scontrol`` names them and records ``requeue`` in ``tmp/requeued``."""
    bin_dir = tmp / "slurm_bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        "#!/usr/bin/env bash\n"
        'case "$1 $2" in\n'
        f'  "show hostnames") printf "%s\\n" {" ".join(HOSTS)} ;;\n'
        f'  "requeue {JOB_ID}") echo "$*" >> {tmp / "requeued"} ;;\n'
        '  *) echo "scontrol stand-in: $*" >&2; exit 1 ;;\n'
        "esac\n"
    )
    (bin_dir / "scontrol").chmod(0o755)
    return {
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_JOB_NODELIST": "loopback[1-2]",
        "SLURM_GPUS_ON_NODE": "1",
        "SLURM_SUBMIT_DIR": str(tmp),
        "PATH": f"{bin_dir}:{path}",
    }


def node_processes(config: Path) -> list[psutil.Process]:
    """Every process of a launch of ``config`` on this machine: both nodes' launchers, their ranks and
    the ranks' descendants (fork servers, loader workers)."""
    found = {}
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if str(config) in cmdline and "deepspeed.launcher.launch" in cmdline:  # (pdsh's has it too)
            found.update((p.pid, p) for p in [proc, *proc.children(recursive=True)])
    return list(found.values())


class FaultRun:
    """launchers/multi_node.sh on both "nodes" with a config of its own, saving every 3 steps; or, with
    ``slurm``, launchers/slurm.sbatch run by bash as sbatch would on an allocation of both (SLURM's
    environment, and a stand-in ``scontrol`` that names both hosts and records a requeue), which writes the
    hostfile and runs multi_node.sh."""

    def __init__(
        self, ssh, tmp_path: Path, steps: int, train: dict | None = None, slurm: bool = False, **env: str
    ) -> None:
        self.out, self.config = tmp_path / "run", tmp_path / "config.json"
        env = {
            **two_node_run(
                ssh, tmp_path, output_dir=str(self.out), save_every_steps=3, steps=steps, **(train or {})
            ),
            **env,
        }
        command = [REPO / "launchers" / "multi_node.sh", self.config]
        if slurm:
            command = [REPO / "launchers" / "slurm.sbatch", self.config]
            env.update(fake_slurm(tmp_path, env["PATH"]), EVA_FASTCLIP_ROOT=str(REPO))
            # the rank pool's threads a rank (tests/rank_pool.py: the cores shared by 2 ranks), so that the
            # runs compared with this one sum in the same order, to the bit
            threads = max(1, (os.cpu_count() or 1) // 2)
            (tmp_path / ".deepspeed_env").write_text(f"OMP_NUM_THREADS={threads}\n")
        self.env, self.log = env, tmp_path / "run.log"
        self.output = open(self.log, "w")  # noqa: SIM115 (closed in wait)
        self.proc = subprocess.Popen(
            command,
            cwd=tmp_path, env=env, stdout=self.output, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def wait_for_step(self, step: int) -> None:
        steps, deadline = self.out / "train_log.jsonl", time.monotonic() + 300
        while not (steps.exists() and len(steps.read_text().splitlines()) >= step):
            assert self.proc.poll() is None, self.log.read_text()[-4000:]
            assert time.monotonic() < deadline, f"step {step} not reached"
            time.sleep(0.1)

    def node(self, node_rank: int) -> list[psutil.Process]:
        """Node ``node_rank``'s launch.py, its rank and the rank's descendants."""
        processes = node_processes(self.config)
        # (pdsh's ssh to the node has the same arguments)
        launches = [
            p
            for p in processes
            if p.name().startswith("python") and "deepspeed.launcher.launch" in p.cmdline()
        ]
        (launch,) = [p for p in launches if f"--node_rank={node_rank}" in p.cmdline()]
        return [launch, *launch.children(recursive=True)]

    def rank(self, node_rank: int) -> psutil.Process:
        """Node ``node_rank``'s only rank: its launch.py's child (its fork server has the same command)."""
        (rank,) = self.node(node_rank)[0].children()
        return rank

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            kill_tree(self.proc)  # (the launch supervisor's deepspeed runs in a session of its own)
            self.output.close()

    def signal_node2_rank(self, send) -> tuple[int, float, float, list[psutil.Process]]:
        """At step 7 (past the save of step 6), ``send(node 2's rank)``; then the launch's exit code, the
        seconds until the ``deepspeed`` command returned and until every process of the run had ended
        (waiting up to 60 s from the signal), and those still alive."""
        self.wait_for_step(7)
        processes = node_processes(self.config)
        rank = self.rank(1)
        sent = time.monotonic()
        send(rank)
        code = self.wait(timeout=300)
        runner_done = time.monotonic() - sent
        alive = still_running(processes, timeout=max(1.0, 60 - runner_done))
        return code, runner_done, time.monotonic() - sent, alive

    def latest_step(self) -> int:
        latest = checkpoint.resolve_resume("latest", self.out / "checkpoints")
        assert latest is not None and checkpoint.is_complete(latest)
        return checkpoint.read_marker(latest)["step"]


def test_a_stopped_rank_on_the_second_node_ends_the_run_on_both(ssh, tmp_path):
    """SIGSTOP to node 2's rank, its node's only one: rank 0's watchdog ends the hang and marks the run
    aborted, node 2's guardian SIGKILLs the stopped rank, and every launcher exits (before the guardians,
    node 2's launch.py waited for its stopped rank for good)."""
    # a loaded machine may let the run reach a scheduled save (every 3 steps) before the stop lands: the
    # long allowance of a save then applies, 90 s here rather than the default's minutes
    run = FaultRun(ssh, tmp_path, steps=5000, train={"hang_timeout_s": 8, "hang_timeout_long_s": 90})
    code, runner_done, all_done, alive = run.signal_node2_rank(psutil.Process.suspend)
    text = run.log.read_text()
    print(
        f"node 2's rank stopped: the deepspeed command returned {code} after {runner_done:.1f} s, every "
        f"process of both nodes gone after {all_done:.1f} s (train.hang_timeout_s=8)"
    )
    assert code != 0
    assert not alive, f"left behind: {[(p.pid, p.cmdline()[-4:]) for p in alive]}"
    assert "no progress for" in text and "guardian of rank 1: rank 0 (" in text and "ended a hang" in text, (
        text[-4000:]
    )
    assert run.latest_step() >= 6


SIGTERM_RUN_STEPS, STOP_AT = 16, 4  # the stop takes 2-6 steps to reach the ranks here (ssh, pkill)


@pytest.fixture(scope="module")
def sigterm_run(ssh, rank_pool, tmp_path_factory):
    """A SLURM job on both "nodes" (a FaultRun through launchers/slurm.sbatch, 16 steps, checkpoints every 3,
    2 kept) stopped after step 4 as ``--signal=B:USR1`` stops it: SIGUSR1 to the batch shell alone, then
    SIGKILL to every process of the job left the moment the script returns (SLURM's teardown). Then its
    checkpoint resumed on one node (2 ranks of the rank pool: what is under test is the two nodes'
    checkpoint, not a launcher) to the end, with no scheduled save between, and an uninterrupted run of
    the same config (the rank pool, 2 ranks) to compare it with. The launch directory is the FaultRun's:
    multi_node.sh writes .deepspeed_env there, not in the checkout."""
    tmp = tmp_path_factory.mktemp("sigterm")
    sshd_log_start = ssh["log"].stat().st_size
    run = FaultRun(ssh, tmp, steps=SIGTERM_RUN_STEPS, train={"keep_checkpoints": 2}, slurm=True)
    run.wait_for_step(STOP_AT)
    processes, ranks = node_processes(run.config), [run.rank(0), run.rank(1)]
    assert run.latest_step() == 3  # (a scheduled save, every 3 steps: the stop's is another)
    job = [psutil.Process(run.proc.pid), *psutil.Process(run.proc.pid).children(recursive=True)]
    signalled = time.monotonic()
    run.proc.send_signal(signal.SIGUSR1)  # the batch shell only (B:)
    code = run.wait(timeout=300)
    returned = time.monotonic() - signalled
    record = read_exit(run.out)  # what the run recorded of its end (the resume below writes its own)
    ranks_left = [(p.pid, cmdline(p)[-4:]) for p in still_running(ranks, timeout=0)]
    left = [(p.pid, cmdline(p)[-4:]) for p in still_running([*processes, *job], timeout=0)]
    for leftover in [*processes, *job]:  # the scheduler's SIGKILL, the moment the script returned
        with contextlib.suppress(psutil.NoSuchProcess):
            leftover.kill()
    logins = ssh["log"].read_text()[sshd_log_start:]
    two_nodes = run.log.read_text()
    logged = len((run.out / "train_log.jsonl").read_text().splitlines())
    saved = run.latest_step()
    resume = ["--set", "train.save_every_steps=0", "--resume", "latest"]
    program = ["--module", "eva_fastclip", "train", "--config", str(run.config), *resume]
    one_node = run_ranks(2, program, tmp / "one_node.log", pool=rank_pool)
    whole = tmp / "whole"
    program = ["--module", "eva_fastclip", "train", "--config", str(run.config)]
    program += ["--set", "train.save_every_steps=0", "--set", f"train.output_dir={whole}"]
    run_ranks(2, program, tmp / "whole.log", pool=rank_pool)
    return {
        "out": run.out,
        "whole": whole,
        "work": tmp,
        "env": run.env,
        "logs": (two_nodes, one_node),
        "logins": logins,
        "code": code,
        "record": record,
        "ranks_left": ranks_left,
        "left": left,
        "returned": returned,
        "logged": logged,
        "saved": saved,
    }


def test_the_slurm_job_returns_75_after_the_step_in_flight_is_saved_on_both_nodes(sigterm_run):
    """SLURM's ``--signal=B:USR1`` to the batch script: its trap passes a SIGTERM to the launch supervisor,
    which passes it to DeepSpeed's runner, whose handler pkills every node's launch.py over pdsh; the ranks
    finish the step in flight, save it together and exit 75. The runner returns at once, but the supervisor
    waits for rank 0 (on another "host": not its descendant) to give up the output folder, and returns the
    75 the run recorded; the script requeues the job. No rank is left when it returns (on the other nodes,
    launch.py may still be in its last second's poll), and no step is lost: the checkpoint's step is the
    last one logged."""
    saved, logged = sigterm_run["saved"], sigterm_run["logged"]
    print(
        f"SIGUSR1 to the batch script: saved step {saved} of {logged} logged; the script returned "
        f"{sigterm_run['code']} {sigterm_run['returned']:.1f} s after the signal; then SIGKILL to "
        f"{len(sigterm_run['left'])} process(es) still exiting: {sigterm_run['left']}"
    )
    assert sigterm_run["code"] == 75, (sigterm_run["record"], sigterm_run["logs"][0][-4000:])
    assert not sigterm_run["ranks_left"], f"ranks alive when the script returned: {sigterm_run['ranks_left']}"
    # the ranks' output ends with pdsh, before the save: the checkpoint tells (scheduled ones every 3 steps)
    assert saved == logged, sigterm_run["logs"][0][-4000:]  # the step in flight was saved: nothing lost
    assert (sigterm_run["work"] / "requeued").read_text().split() == ["requeue", JOB_ID]
    hostfile = sigterm_run["work"] / f"hostfile.{JOB_ID}"
    assert hostfile.read_text().splitlines() == [f"{host} slots=1" for host in HOSTS]


def test_the_two_node_run_resumed_on_one_node_ends_as_the_uninterrupted_run(sigterm_run):
    """Every step's logged loss, metrics and lr of the stopped run and its resume equal the uninterrupted
    run's, and so do the final weights."""
    out, whole = sigterm_run["out"], sigterm_run["whole"]
    assert step_log(out) == step_log(whole)
    final = checkpoint.tag_for_step(SIGTERM_RUN_STEPS)
    want = consolidated_state_dict(whole / "checkpoints" / final)
    got = consolidated_state_dict(out / "checkpoints" / final)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=0, msg=name)


def test_hostfile_launch_runs_one_rank_on_each_host(sigterm_run):
    two_nodes = sigterm_run["logs"][0]
    # pdsh prefixes every line with the host it came from; DeepSpeed's launcher there names its node rank
    for node_rank, host in enumerate(HOSTS):
        assert f"{host}: " in two_nodes
        assert any(
            line.startswith(f"{host}: ") and f"nnodes=2, num_local_procs=1, node_rank={node_rank}" in line
            for line in two_nodes.splitlines()
        ), f"no launcher of node rank {node_rank} on {host}"
    # sshd saw logins to both addresses during the launch (not just the test's own probes before it)
    for host in HOSTS:
        assert f" on {host} port " in sigterm_run["logins"]
    # PATH reached the remote ranks through .deepspeed_env in the launch directory, with the venv first
    # after the test's ssh
    path = sigterm_run["env"]["PATH"]
    recorded = (sigterm_run["work"] / ".deepspeed_env").read_text().splitlines()
    assert recorded[0].startswith("OMP_NUM_THREADS=") and recorded[1:] == [f"PATH={path}"]
    assert f"export PATH={path};" in two_nodes or f'export PATH="{path}";' in two_nodes  # quoted if need be


def test_two_node_checkpoint_is_complete(sigterm_run):
    saved = sigterm_run["saved"]
    folder = sigterm_run["out"] / "checkpoints" / checkpoint.tag_for_step(saved)
    marker = json.loads((folder / checkpoint.MARKER).read_text())
    assert {key: marker[key] for key in ("step", "tag", "world_size")} == {
        "step": saved,
        "tag": folder.name,
        "world_size": 2,
    }
    # each node's rank wrote its own ZeRO partition into the shared output folder
    for rank in range(2):
        assert len(list(folder.glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))) == 1
    assert (folder / "mp_rank_00_model_states.pt").is_file()


def test_resume_on_one_node_continues_from_the_saved_step(sigterm_run):
    one_node, saved, out = sigterm_run["logs"][1], sigterm_run["saved"], sigterm_run["out"]
    first = out / "checkpoints" / checkpoint.tag_for_step(saved)
    assert f"resumed from {first} at step {saved}" in one_node
    kept = checkpoint.complete_checkpoints(out / "checkpoints")
    last = checkpoint.tag_for_step(SIGTERM_RUN_STEPS)
    assert [p.name for p in kept] == [checkpoint.tag_for_step(saved), last]
    assert checkpoint.read_marker(kept[-1])["world_size"] == 2  # the two nodes' world, on one
    # the stopped run logged steps 1..saved (the stopped step's scalars before it saved), the resumed one
    # the rest: each step in TensorBoard once
    assert sorted(logged_steps(out)) == list(range(1, SIGTERM_RUN_STEPS + 1))


def test_a_killed_rank_ends_the_run_on_both_and_a_lost_node_is_left_out_on_restart(ssh, tmp_path):
    """MAX_RESTARTS=1 MIN_NODES=1. At step 7 node 2 is lost: its sshd stopped, then its rank SIGKILLed.
    First, as with the default settings: node 1's rank fails in its next collective (the peer's sockets
    closed), every launcher exits within a minute, the ``deepspeed`` command fails, and ``latest`` still
    names a complete checkpoint. Then the restart supervisor finds node 2 gone, and the run goes on from
    that checkpoint on node 1 alone (1 rank: the global batch and every-sample-once hold across the
    change) to its last step."""
    run = FaultRun(ssh, tmp_path, steps=14, MAX_RESTARTS="1", MIN_NODES="1")
    run.wait_for_step(7)
    node2 = HOSTS[1]
    first_launch = node_processes(run.config)
    rank = run.rank(1)
    step_log = run.out / "train_log.jsonl"
    before = step_log.stat().st_ino  # the resumed run rewrites the log without the steps it trains again
    lost = time.monotonic()
    first_step = None  # seconds from the loss to the first step after the restart
    try:
        ssh["sshd"][node2].kill()  # its listener: no new login (the launch's own sessions go on)
        ssh["sshd"][node2].wait(timeout=30)
        rank.kill()
        alive = still_running(first_launch, timeout=60)
        first_gone = time.monotonic() - lost
        while run.proc.poll() is None and time.monotonic() - lost < 600:
            resumed = re.search(r"restart 1 of 1: .* resuming from step (\d+)", run.log.read_text())
            rewritten = resumed and step_log.stat().st_ino != before
            if first_step is None and rewritten and len(step_log.read_text().splitlines()) > int(resumed[1]):
                first_step = time.monotonic() - lost
            time.sleep(0.1)
        code = run.wait(timeout=60)
    finally:
        ssh["start"](node2)  # for whatever runs after
    text = run.log.read_text()
    (restart,) = [line for line in text.splitlines() if "restart 1 of 1:" in line]
    resumed = next(line for line in text.splitlines() if "resumed from" in line)
    steps = [json.loads(line) for line in (run.out / "train_log.jsonl").read_text().splitlines()]
    print(
        f"node 2's rank SIGKILLed: every process of both nodes' launch gone after {first_gone:.1f} s; "
        f"{restart.split('] ', 1)[1][:110]}; then {resumed.strip()[-60:]}"
    )
    print(f"from node 2's loss to the first step after the restart: {first_step:.1f} s")
    left = [(p.pid, cmdline(p)[-4:]) for p in alive if p.is_running()]
    assert not left, f"left behind: {left}"
    assert first_gone < 60, text[-4000:]
    failed = re.search(r"the run exited with code (-?\d+)", restart)
    assert failed and int(failed[1]) != 0, restart
    assert code == 0, text[-4000:]
    assert f"hosts {node2} do not answer ssh: going on with 1" in text
    assert "resuming from step 6 (" in restart or "resuming from step 9 (" in restart, restart
    assert "dist_world_size=1" in text
    assert steps[-1]["step"] == 14 and run.latest_step() == 14
    assert first_step is not None
