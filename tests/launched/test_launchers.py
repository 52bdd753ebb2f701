"""launchers/single_node.sh hands DeepSpeed's launcher the GPUs the job was given: the launcher drops
CUDA_VISIBLE_DEVICES once --num_gpus is passed and takes GPUs 0..N-1, another job's on a shared node.
Run against stand-ins for ``deepspeed`` and ``nvidia-smi`` that record what they were called with; and
ranks on a port in use."""

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from launching import REPO, train_args

SCRIPT = REPO / "launchers" / "single_node.sh"


@pytest.fixture
def fake_bin(tmp_path):
    """A PATH entry whose deepspeed prints its arguments and environment, on a node with 8 GPUs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "deepspeed").write_text(
        '#!/usr/bin/env bash\necho "ARGS $*"\necho "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}"\n'
    )
    (bin_dir / "nvidia-smi").write_text(
        '#!/usr/bin/env bash\nfor i in 0 1 2 3 4 5 6 7; do echo "GPU $i: NVIDIA H100 (UUID: GPU-$i)"; done\n'
    )
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


def launch(fake_bin, **env):
    # (an in-process Trainer of an earlier test set MASTER_PORT here, to the port its store still holds)
    base = {
        k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "NUM_GPUS", "MASTER_PORT")
    }
    base["PATH"] = f"{fake_bin}:{base['PATH']}"
    return subprocess.run(
        ["bash", str(SCRIPT), "cfg.json", "--resume", "latest"],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=False,
    )


def called_with(result) -> tuple[list[str], str]:
    assert result.returncode == 0, result.stderr
    args_line, env_line = result.stdout.splitlines()
    return args_line.split()[1:], env_line


def test_the_visible_gpus_are_the_ones_used(fake_bin):
    args, env = called_with(launch(fake_bin, CUDA_VISIBLE_DEVICES="4,5,6,7"))
    assert args[:2] == ["--include", "localhost:4,5,6,7"] and "--num_gpus" not in args
    assert env == "CUDA_VISIBLE_DEVICES=unset"  # the launcher sees every GPU; --include picks 4-7
    assert args[-5:] == ["train", "--config", "cfg.json", "--resume", "latest"]


def test_num_gpus_takes_the_first_visible_ones(fake_bin):
    args, _ = called_with(launch(fake_bin, CUDA_VISIBLE_DEVICES="6,2,3", NUM_GPUS="2"))
    assert args[:2] == ["--include", "localhost:6,2"]


def test_without_visible_devices_all_gpus_or_num_gpus(fake_bin):
    args, _ = called_with(launch(fake_bin))
    assert args[:2] == ["--num_gpus", "8"]
    args, _ = called_with(launch(fake_bin, NUM_GPUS="3"))
    assert args[:2] == ["--num_gpus", "3"]


@pytest.mark.parametrize(
    "env, message",
    [
        ({"CUDA_VISIBLE_DEVICES": "GPU-1f2e,GPU-3a4b"}, "takes GPU indices, not 'GPU-1f2e'"),
        ({"CUDA_VISIBLE_DEVICES": "0,1", "NUM_GPUS": "4"}, "names 2 GPU(s): set NUM_GPUS between 1 and 2"),
    ],
)
def test_what_cannot_be_honoured_is_refused(fake_bin, env, message):
    result = launch(fake_bin, **env)
    assert result.returncode == 2 and message in result.stderr and "ARGS" not in result.stdout


def test_a_free_port_unless_master_port_is_set(fake_bin):
    """Two runs on one node no longer both take DeepSpeed's 29500: unset, MASTER_PORT is a free port."""
    args, _ = called_with(launch(fake_bin))
    port = int(args[args.index("--master_port") + 1])
    with socket.socket() as probe:
        probe.bind(("", port))  # free, now that the stand-in launcher has exited
    args, _ = called_with(launch(fake_bin, MASTER_PORT=str(port)))
    assert args[args.index("--master_port") + 1] == str(port)


def test_a_port_in_use_is_one_line_naming_master_port(fake_bin):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = launch(fake_bin, MASTER_PORT=str(port))
    assert result.returncode == 2 and "ARGS" not in result.stdout
    assert result.stderr.strip() == (
        f"single_node.sh: MASTER_PORT={port} is in use on this host (another run?): set MASTER_PORT to a "
        "free port, or unset it to have one picked"
    )


@pytest.mark.parametrize(
    "value, what",
    [("abc", "is not a port number"), ("0", "is not a port (1-65535)"), ("70000", "is not a port (1-65535)")],
)
def test_a_master_port_that_is_no_port_is_named_as_such(fake_bin, value, what):
    """Not "in use (another run?)" for a value that is no port at all."""
    result = launch(fake_bin, MASTER_PORT=value)
    assert result.returncode == 2 and "ARGS" not in result.stdout
    assert result.stderr.strip() == (
        f"single_node.sh: MASTER_PORT={value} {what}: set MASTER_PORT to a free port, or unset it to have "
        "one picked"
    )


def test_a_port_below_1024_without_root_is_named_as_such(tmp_path):
    """Only root may listen below 1024: as another user, port 80 is refused for that, not as in use. The
    check runs as nobody (setpriv) where the test runs as root."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="master_port_"))  # readable by nobody, unlike pytest's tmp_path
    try:
        shutil.copy(REPO / "launchers" / "master_port.sh", folder / "master_port.sh")
        folder.chmod(0o755)
        (folder / "master_port.sh").chmod(0o644)
        command = ["bash", "-c", f"source {folder}/master_port.sh; echo $MASTER_PORT"]
        if os.geteuid() == 0:
            if not shutil.which("setpriv"):
                pytest.skip("running as root without setpriv: no unprivileged user to try port 80 as")
            command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "MASTER_PORT": "80"}
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=False, timeout=30)
    finally:
        shutil.rmtree(folder)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "MASTER_PORT=80 is below 1024, which only root may listen on" in result.stderr


def test_a_live_stores_port_is_refused(fake_bin):
    """A run's own listener, PyTorch's TCPStore (rank 0's), as a second run on its port meets it."""
    from torch.distributed import TCPStore

    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    result = launch(fake_bin, MASTER_PORT=str(port))
    del store
    assert result.returncode == 2 and "ARGS" not in result.stdout
    assert f"MASTER_PORT={port} is in use on this host" in result.stderr


def test_a_port_a_finished_run_left_in_time_wait_is_taken(fake_bin):
    """Right after a run ends, its store's port sits in TIME_WAIT for about a minute: a plain bind fails
    there, TCPStore's (SO_REUSEADDR) does not, so a new run on the same MASTER_PORT must start."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    server_side, _ = listener.accept()
    server_side.close()  # the store closes first, as a finished rank 0 does: its end waits in TIME_WAIT
    client.close()
    listener.close()
    with socket.socket() as plain, pytest.raises(OSError, match="Address already in use"):
        plain.bind(("", port))  # what the launcher tested before: refused in TIME_WAIT
    args, _ = called_with(launch(fake_bin, MASTER_PORT=str(port)))
    assert args[args.index("--master_port") + 1] == str(port)


def test_the_launchers_refuse_a_bad_max_restarts():
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}  # (an in-process run's, maybe)
    env.update(MAX_RESTARTS="two", NUM_GPUS="1")
    result = subprocess.run(
        [SCRIPT, "configs/toy.json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "MAX_RESTARTS=two and MIN_NODES=1 must be whole numbers" in result.stderr


def test_a_rank_on_a_port_in_use_says_so_in_one_line(tmp_path, toy_data, rank_pool):
    """MASTER_PORT a port another process listens on: rank 0 cannot listen there and stops with one line
    naming MASTER_PORT (exit 2), not PyTorch's EADDRINUSE trace; the launch ends. The ranks come from the
    rank pool (its supervisor ends the other rank, as launch.py does): what is under test is the rank's
    process set-up (reliability/process.py), which reads the port from the environment either way."""
    args = train_args(
        f'data.train_shards=["{toy_data / "train"}"]',
        "model.name=test-vit-xs",
        "train.batch_size=8",
        "eval.zeroshot_dir=null",
        "eval.retrieval_shards=null",
        f"train.output_dir={tmp_path / 'run'}",
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        group = rank_pool.launch(2, ["--module", "eva_fastclip", *args], tmp_path / "ranks.log", port=port)
        try:
            code = group.wait(300)
        finally:
            group.kill()
    output = group.output()
    assert code != 0, output[-3000:]
    assert f"eva-fastclip train: error: MASTER_PORT={port} is in use on " in output, output[-3000:]
    assert "Traceback" not in output and "EADDRINUSE" not in output, output[-3000:]
    print(f"the launch ended {time.monotonic() - started:.1f} s after it started")
