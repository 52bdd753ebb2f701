"""Launching test programs through the real ``deepspeed`` launcher, each launch on a free port."""

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env() -> dict[str, str]:
    """This venv's launcher and ninja first on PATH (DeepSpeed builds its CPU comm op with it)."""
    bin_dir = Path(sys.executable).parent
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}


def launch_ranks(ranks: int, program: list[str], timeout: int = 600) -> str:
    """``deepspeed --num_gpus RANKS --master_port FREE PROGRAM...`` from the repository root; its output,
    or a failed assertion with the output's end."""
    deepspeed = str(Path(sys.executable).parent / "deepspeed")
    proc = subprocess.run(
        [deepspeed, "--num_gpus", str(ranks), "--master_port", str(free_port()), *program],
        cwd=REPO,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return output
