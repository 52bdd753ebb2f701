"""Starting ranks in tests, every launch on a free port.

- :class:`Launch`: ``deepspeed --num_gpus RANKS --master_port FREE PROGRAM...``, the real launcher, in a
  session of its own (a kill reaches every process of the launch). For what the launcher itself takes
  part in: its signals, its exit codes, the user's command end to end.
- ``rank_pool`` (tests/conftest.py, tests/rank_pool.py): the same ranks forked from a server that imported
  torch, DeepSpeed, open_clip and eva_fastclip once, with launch.py's environment; seconds instead of half a
  minute. For every launch that only needs N ranks.

:func:`run_ranks` runs a launch of either kind to its end and fails with the output's end unless it exits
as expected.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

REPO = Path(__file__).parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def venv_bin_first(path: str) -> str:
    """``path`` with this venv's bin first (its launcher, and its ninja: DeepSpeed JIT-builds its CPU comm
    op with the first ninja on PATH, and another ninja's hash of the same command rebuilds it)."""
    bin_dir = str(Path(sys.executable).parent)
    return path if path.split(os.pathsep)[0] == bin_dir else os.pathsep.join([bin_dir, path])


def launcher_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment, this venv's bin first on PATH, unbuffered output, ``extra`` on top."""
    path = venv_bin_first(os.environ.get("PATH", ""))
    return {**os.environ, "PATH": path, "PYTHONUNBUFFERED": "1", **(extra or {})}


def train_args(*sets: str, config: str = "configs/toy.json") -> list[str]:
    """``train --config CONFIG --set KEY=VALUE ...``"""
    return ["train", "--config", config, *(arg for item in sets for arg in ("--set", item))]


class Launch:
    """``deepspeed --num_gpus RANKS --master_port FREE PROGRAM...`` from the repository root, its output in
    ``log``. PROGRAM: ``["--module", "eva_fastclip", ...]`` or ``[SCRIPT, ...]``. With ``script`` (one of
    launchers/, which takes ``NUM_GPUS`` and ``MASTER_PORT`` from the environment): ``SCRIPT PROGRAM...``,
    PROGRAM its arguments (``CONFIG [train options]``); it execs the launch supervisor over the same
    command. ``prefix``: what runs the script (``unshare ...``)."""

    def __init__(
        self,
        ranks: int,
        program: Sequence[str],
        log: Path,
        *,
        env: dict[str, str] | None = None,
        preexec_fn=None,
        script: Path | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        self.log, self.port = Path(log), free_port()
        if script is None:
            deepspeed = str(Path(sys.executable).parent / "deepspeed")
            command = [deepspeed, "--num_gpus", str(ranks), "--master_port", str(self.port), *program]
        else:
            command = [*prefix, str(script), *program]
            env = {**(env or {}), "NUM_GPUS": str(ranks), "MASTER_PORT": str(self.port)}
        self._out = open(self.log, "w")  # noqa: SIM115 (closed in wait)
        self.proc = subprocess.Popen(
            command, cwd=REPO, env=launcher_env(env), stdout=self._out, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=preexec_fn,
        )  # fmt: skip
        sets = [arg.split("=", 1) for arg in program if "=" in arg]
        self.output_dir = next((Path(value) for key, value in sets if key == "train.output_dir"), None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float = 600) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._out.close()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """``sig`` to every process of the launch: its session (launcher, ranks, their loader workers) and,
        while it runs, its descendants in sessions of their own (the launch supervisor's ``deepspeed``)."""
        kill_tree(self.proc, sig)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def processes(self) -> list[psutil.Process]:
        """The runner's and every descendant's processes: launch.py, the ranks, their workers."""
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def rank(self, local_rank: int) -> psutil.Process:
        """The rank's own process: a child of launch.py (its loader workers share its command line)."""
        (launch,) = [p for p in self.processes() if "deepspeed.launcher.launch" in cmdline(p)]
        (found,) = [p for p in launch.children() if f"--local_rank={local_rank}" in cmdline(p)]
        return found

    def wait_for_step(self, step: int, timeout: float = 300) -> None:
        """Until rank 0 has logged ``step`` (the launch must not end first)."""
        wait_for_step(
            self.output_dir, step, alive=lambda: self.proc.poll() is None, log=self.log, timeout=timeout
        )


def kill_tree(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """``sig`` to ``proc``'s session, and to its descendants while it runs (after its end its pid may be
    another process's)."""
    tree = []
    if proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(proc.pid)
            tree = [root, *root.children(recursive=True)]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    for process in tree:
        with contextlib.suppress(psutil.Error):
            process.send_signal(sig)


def run_ranks(
    ranks: int,
    program: Sequence[str],
    log: Path,
    *,
    pool=None,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    expect: int | None = 0,
) -> str:
    """PROGRAM on ``ranks`` ranks to its end, forked from ``pool`` (the rank_pool fixture) or else through
    the real launcher; its output. ``expect``: the exit code it must end with (None: any but 0)."""
    if pool is not None:
        group = pool.launch(ranks, program, log, env=env)
        try:
            code = group.wait(timeout)
        except TimeoutError:
            group.kill()
            raise
        output = group.output()
    else:
        launch = Launch(ranks, program, log, env=env)
        try:
            code = launch.wait(timeout)
        finally:
            launch.kill()
        output = launch.output()
    if expect is None:
        assert code != 0, f"the launch did not fail:\n{output[-6000:]}"
    else:
        assert code == expect, f"exit code {code}, not {expect}:\n{output[-6000:]}"
    return output


def launch_ranks(ranks: int, program: list[str], timeout: int = 600) -> str:
    """``deepspeed --num_gpus RANKS --master_port FREE PROGRAM...`` to its end (exit code 0); its output."""
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"launch_{os.getpid()}_{time.monotonic_ns()}.log"
    try:
        return run_ranks(ranks, program, log, timeout=timeout)
    finally:
        log.unlink(missing_ok=True)


def wait_for_step(output_dir: Path, step: int, *, alive, log: Path, timeout: float = 300) -> None:
    """Until the run's step log has ``step`` lines; fails if the run ends first (``alive()`` False)."""
    path = output_dir / "train_log.jsonl"
    deadline = time.monotonic() + timeout
    while not (path.exists() and len(path.read_text().splitlines()) >= step):
        assert alive(), f"the run ended first:\n{log.read_text(errors='replace')[-4000:]}"
        assert time.monotonic() < deadline, "no step logged in time"
        time.sleep(0.05)


def cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:  # ended meanwhile (a zombie until reaped)
        return []


def still_running(processes: Sequence[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of ``processes`` still running after up to ``timeout`` s; each taken to have ended once it is
    gone or a zombie. (A zombie runs nothing and holds nothing but its pid until its parent waits for it;
    an orphan's parent is PID 1, which on some machines reaps every few seconds: ~7 s on the firecracker
    VMs these tests run on, where ``psutil.wait_procs`` counted that wait into every shutdown timed.)"""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in processes if _running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def all_gone(processes: list[psutil.Process], timeout: float) -> float:
    """Seconds until every process has ended (:func:`still_running`); fails naming those left after
    ``timeout``."""
    started = time.monotonic()
    alive = still_running(processes, timeout)
    assert not alive, f"left behind: {[(p.pid, cmdline(p)[-6:]) for p in alive]}"
    return time.monotonic() - started
