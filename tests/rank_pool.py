"""K ranks of a program forked from a server that imported it once: a fast stand-in, for tests, for
``deepspeed --num_gpus K --master_port P PROGRAM...`` on one host.

A rank under the launcher spends most of its start importing torch, DeepSpeed, open_clip and eva_fastclip,
and the ``deepspeed`` runner and its launch.py import DeepSpeed once more each. Here one server process
imports them once (and runs no torch op: no OpenMP pool exists to be broken by a fork). Each launch forks a
supervisor from it, in a session of its own (launch.py's part: ``group.kill()`` signals the whole group),
which forks the K ranks. Each rank takes launch.py's environment, writes its stdout and stderr to the
group's log and runs PROGRAM as ``python -u [-m] PROGRAM --local_rank=N ARGS...`` would (runpy), ending
through the interpreter's normal shutdown (non-daemon threads joined, atexit run, streams flushed).

    pool = RankPool(REPO)                      # the imports start now, in the background
    group = pool.launch(2, ["--module", "eva_fastclip", "train", ...], log=tmp_path / "ranks.log")
    assert group.wait(timeout=600) == 0, group.output()[-6000:]
    pool.close()                               # kills what is still running

As under launch.py: the environment (CUDA_VISIBLE_DEVICES, MASTER_ADDR, MASTER_PORT, WORLD_SIZE, CROSS_RANK,
CROSS_SIZE, LOCAL_SIZE, RANK, LOCAL_RANK; not LOCAL_WORLD_SIZE, which launch.py does not set either; plus
what the imports put in os.environ), the ``--local_rank=N`` argument, and once a rank exits non-zero (or
the supervisor gets SIGTERM, SIGINT, SIGHUP), SIGTERM to every rank's process tree and SIGKILL ``grace_s``
later. random, NumPy's and torch's generators are seeded from the OS in each rank, as in a fresh process.
Not as under it: the ranks' parent is no launch.py (engine/preemption.py watches no launcher) and their
/proc cmdline is the server's (``group.pids`` names them); what is read only at start-up is the server's
(str's hash secret, shared by every rank and launch; PYTHONPATH; huggingface_hub's HF_* constants; OMP_*
as torch loads; DeepSpeed's accelerator): a launch whose STARTUP_ENV differs from the server's is refused;
no launcher log lines; the ranks write to one file (O_APPEND), not to the caller's stdout. The supervisor
is a child subreaper: what a rank leaves behind becomes its child; it waits 5 s for those, SIGKILLs the
rest and names them in ``group.leftovers``. ``group.cpu_s``: CPU time of the whole group (ranks, loader
fork servers and workers, guardians). Each rank's loader fork server is forked from the rank as it starts
(eva_fastclip's ``fork_worker_server``, as its train command forks it; here for every program the rank
runs), and is there whether or not the rank starts workers.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

#: what the server imports before it forks anything: the program's imports, and those a rank would
#: make later, each time: DeepSpeed's ZeRO optimizer check (its Muon optimizer: torch._inductor), the
#: C++ extension loader its comm op builds with, the TensorBoard writer (~2 s of imports a rank here)
PRELOAD = (
    "torch",
    "deepspeed",
    "open_clip",
    "eva_fastclip.cli",
    "eva_fastclip.engine.trainer",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "torch.utils.cpp_extension",
    "torch.utils.tensorboard",
)
#: read once, when the server starts or imports (Python; huggingface_hub's constants; OpenMP and MKL as torch
#: loads; DeepSpeed's accelerator): a launch cannot change them, so it refuses to
STARTUP_ENV = ("PYTHONHASHSEED", "PYTHONPATH", "HF_", "TRANSFORMERS_", "OMP_", "MKL_", "KMP_", "DS_ACCEL")
#: launch.py's wait between its SIGTERM to the ranks and its SIGKILL
LAUNCHER_GRACE_S = 30.0
#: how long the processes the ranks leave behind may take to end by themselves
LEFTOVER_WAIT_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankGroup:
    """One launch: its supervisor's pid (the process group's id) and, once ended, the ranks' exit codes."""

    def __init__(self, pool: RankPool, pid: int, log: Path) -> None:
        self._pool, self.pid, self.log = pool, pid, log
        self._pids: list[int] | None = None
        self.code: int | None = None  # the first non-zero exit code in order of exit (launch.py's), else 0
        self.codes: list[int] = []  # each rank's; -N: killed by signal N
        self.cpu_s: float | None = None
        self.leftovers: list[str] = []

    @property
    def pids(self) -> list[int]:
        """The ranks' pids, by rank (their /proc cmdline is the server's: no --local_rank=N to find)."""
        self._pool._until(lambda: self._pids is not None, 60)
        return self._pids

    def wait(self, timeout: float | None = None) -> int:
        self._pool._until(lambda: self.code is not None, timeout)
        return self.code

    def poll(self) -> int | None:
        """The exit code if the group has ended, else None, without waiting."""
        with contextlib.suppress(TimeoutError):
            self.wait(0)
        return self.code

    def rank(self, rank: int):
        """The rank's psutil.Process."""
        import psutil

        return psutil.Process(self.pids[rank])

    def processes(self) -> list:
        """The supervisor's and every descendant's psutil.Process: the ranks, fork servers, workers."""
        import psutil

        root = psutil.Process(self.pid)
        return [root, *root.children(recursive=True)]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal every process of the group (supervisor, ranks, their workers); SIGKILL ends it at once."""
        if self.code is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)
            if sig == signal.SIGKILL:
                self.code, self.codes = -signal.SIGKILL, []

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class RankPool:
    """The server, started at once in the background; ``launch`` waits for its imports the first time."""

    def __init__(
        self,
        cwd: str | Path,
        preload: Sequence[str] = PRELOAD,
        env: dict | None = None,
        log: str | Path | None = None,
    ) -> None:
        """A server in ``cwd`` (the ranks' folder, and sys.path[0] of the imports) with environment ``env``
        (default os.environ: what Python and native libraries read at start-up); its stderr to ``log``."""
        self.cwd, self._env = str(cwd), dict(os.environ if env is None else env)
        with open(log, "ab") if log else contextlib.nullcontext() as stderr:
            self._proc = subprocess.Popen(
                [sys.executable, "-u", __file__, *preload],
                cwd=self.cwd,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                start_new_session=True,  # no Ctrl-C from the terminal: it ends when its stdin does
            )
        self._buffer, self._logs, self._started, self._groups = b"", [], [], {}
        self.ready: dict | None = None  # the server's pid and its imports' CPU time, once done

    def launch(
        self,
        ranks: int,
        program: Sequence[str],
        log: str | Path,
        env: dict[str, str] | None = None,
        port: int | None = None,
        grace_s: float = LAUNCHER_GRACE_S,
    ) -> RankGroup:
        """Start ``ranks`` ranks of PROGRAM (``["--module", NAME, ARGS...]`` or ``[SCRIPT, ARGS...]``, as the
        deepspeed command takes it) in the pool's folder, with os.environ updated by ``env``."""
        asked = env or {}
        frozen = sorted(k for k in asked if k.startswith(STARTUP_ENV) and asked[k] != self._env.get(k))
        if frozen:
            raise ValueError(f"rank pool: {frozen} differ from the server's, read at its start")
        # what this process picked up since the server started (importing scikit-learn sets KMP_*) cannot
        # reach the ranks either: the server's values stand
        env = {k: v for k, v in os.environ.items() if not k.startswith(STARTUP_ENV)}
        env.update({k: v for k, v in self._env.items() if k.startswith(STARTUP_ENV)})
        env.update(asked)
        request = {
            "ranks": ranks,
            "program": list(program),
            "log": str(log),
            "env": env,
            "cwd": self.cwd,
            "port": port or free_port(),
            "grace_s": grace_s,
        }
        self._logs.append(Path(log))
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        self._proc.stdin.flush()
        self._until(lambda: self._started, None)
        return self._started.pop(0)

    def run(self, ranks: int, program: Sequence[str], log: str | Path, timeout: float = 600, **kw):
        """launch and wait; on timeout the group is killed and TimeoutError raised."""
        group = self.launch(ranks, program, log, **kw)
        try:
            group.wait(timeout)
        except TimeoutError:
            group.kill()
            raise
        return group

    def close(self) -> None:
        for group in self._groups.values():
            group.kill()
        if self._proc.poll() is None:
            self._proc.stdin.close()  # the server kills the groups it still has, and exits
            self._proc.wait(timeout=30)
        self._proc.stdout.close()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _until(self, done: Callable[[], object], timeout: float | None) -> None:
        """Read the server's messages until ``done()``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self._proc.stdout.fileno()
        while not done():
            left = None if deadline is None else deadline - time.monotonic()
            if not select.select([fd], [], [], None if left is None else max(left, 0.0))[0]:
                if left is not None and left <= 0:
                    raise TimeoutError(f"rank pool: nothing after {timeout} s")
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError(f"rank pool: the server ended (exit code {self._proc.wait()})")
            self._buffer += chunk
            *lines, self._buffer = self._buffer.split(b"\n")
            for message in map(json.loads, lines):
                if "ready" in message:
                    self.ready = message
                elif "started" in message:
                    group = RankGroup(self, message["started"], self._logs.pop(0))
                    self._groups[group.pid] = group
                    self._started.append(group)
                elif "pids" in message:
                    self._groups[message["group"]]._pids = message["pids"]
                elif (group := self._groups.get(message["done"])) is not None and group.code is None:
                    group.codes, group.code = message["codes"], message["code"]
                    group.cpu_s, group.leftovers = message["cpu_s"], message["leftovers"]


# ---- in the server and the processes forked from it ----------------------------------------------------


def _send(fd: int, **message) -> None:
    os.write(fd, json.dumps(message).encode() + b"\n")  # one write under PIPE_BUF: never interleaved


def _serve(preload: Sequence[str]) -> tuple[str | None, str] | None:
    """The server's loop: a supervisor forked for each request. Returns in a forked rank only: what to run."""
    reply = os.dup(1)
    os.dup2(2, 1)  # what the imports print goes to stderr, not into the replies
    sys.path[0] = os.getcwd()  # as ``python -m``: the folder's package before an installed one
    before = dict(os.environ)
    for name in preload:
        importlib.import_module(name)
    # what the imports put in os.environ (deepspeed: PYTORCH_NVML_BASED_CUDA_CHECK=1) a fresh rank has too
    imported_env = {k: v for k, v in os.environ.items() if before.get(k) != v}
    server, times = os.getpid(), os.times()
    _send(reply, ready=server, cpu_s=times.user + times.system)
    groups, buffer = set(), b""
    try:
        while True:
            readable = select.select([0], [], [], 1.0)[0]
            groups -= _reaped()
            if not readable:
                continue
            chunk = os.read(0, 1 << 20)
            if not chunk:
                break
            *lines, buffer = (buffer + chunk).split(b"\n")
            for line in lines:
                pid = os.fork()
                if pid == 0:
                    return _supervise({**json.loads(line), "imported_env": imported_env}, reply)
                groups.add(pid)
                _send(reply, started=pid)
    finally:
        if os.getpid() == server:  # not a supervisor or rank forked here, leaving this frame
            for pid in groups:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            for pid in groups:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
    return None


def _reaped() -> set[int]:
    pids = set()
    with contextlib.suppress(ChildProcessError):
        while (pid := os.waitpid(-1, os.WNOHANG)[0]) != 0:
            pids.add(pid)
    return pids


def _supervise(request: dict, reply: int) -> tuple[str | None, str]:
    """launch.py's part: start the ranks, stop them all once one fails, report. Returns in a rank only."""
    import psutil

    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans come to us
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    pids = {}
    for rank in range(request["ranks"]):
        pid = os.fork()
        if pid == 0:
            os.close(reply)
            return _rank(request, rank, log)
        pids[pid] = rank
    os.close(log)
    _send(reply, group=os.getpid(), pids=list(pids))
    codes, code, kill_at = [None] * request["ranks"], 0, None

    def signal_trees(sig: int) -> None:  # launch.py's terminate_process_tree
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                for process in [*psutil.Process(pid).children(recursive=True), psutil.Process(pid)]:
                    with contextlib.suppress(psutil.Error):
                        process.send_signal(sig)

    def stop(signum, frame) -> None:  # launch.py's: SIGTERM to every rank's tree, SIGKILL grace_s later
        nonlocal kill_at
        signal_trees(signal.SIGTERM)
        kill_at = kill_at or time.monotonic() + request["grace_s"]

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    while pids:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            if kill_at is not None and time.monotonic() > kill_at:
                signal_trees(signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(0.05)
            continue
        if pid not in pids:
            continue  # a rank's orphan: reaped, its CPU time counted
        rank = pids.pop(pid)
        codes[rank] = os.waitstatus_to_exitcode(status)
        if codes[rank] != 0 and code == 0:
            code = codes[rank]
            stop(None, None)
    leftovers, end = [], time.monotonic() + LEFTOVER_WAIT_S
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                if time.monotonic() < end:
                    time.sleep(0.05)
                    continue
                for process in psutil.Process().children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        leftovers.append(" ".join(process.cmdline()))
                        process.kill()
                end = float("inf")
                os.waitpid(-1, 0)
        except ChildProcessError:
            break
    times = os.times()
    cpu_s = times.children_user + times.children_system
    _send(reply, done=os.getpid(), codes=codes, code=code, cpu_s=cpu_s, leftovers=leftovers)
    os._exit(0)


def _rank(request: dict, rank: int, log: int) -> tuple[str | None, str]:
    """A rank's process as launch.py starts it; returns (module, None) or (None, script) to run."""
    ranks = request["ranks"]
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update(request["imported_env"])  # what the server's imports set (over the same environment)
    os.environ.update(  # launch.py's, in its order
        CUDA_VISIBLE_DEVICES=",".join(map(str, range(ranks))),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(request["port"]),
        WORLD_SIZE=str(ranks),
        CROSS_RANK="0",
        CROSS_SIZE="1",
        LOCAL_SIZE=str(ranks),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
    )
    os.chdir(request["cwd"])
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    program = request["program"]
    module, script = (program[1], None) if program[0] == "--module" else (None, program[0])
    args = program[2:] if module else program[1:]
    sys.argv = [module or script, f"--local_rank={rank}", *args]  # runpy sets sys.argv[0]
    sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.abspath(script))
    # seeded from the OS, as in a fresh process (random reseeds itself at fork); not the server's, shared
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    from eva_fastclip.data.workers import fork_worker_server

    fork_worker_server()  # forked from this single-threaded rank, as the rank's train command does
    return module, script


if __name__ == "__main__":
    job = _serve(sys.argv[1:])
    if job is not None:  # a rank: exits as ``python -u -m MODULE`` / ``python -u SCRIPT`` would
        module, script = job
        del job
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
