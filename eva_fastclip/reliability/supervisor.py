"""The command a scheduler runs: ``deepspeed`` under a supervisor that returns only after the run's save.

    python -m eva_fastclip.reliability.supervisor [--max-restarts N] [--min-nodes M] -- \
        deepspeed ... --module eva_fastclip train --config C ...

launchers/single_node.sh, multi_node.sh, demo.sh and slurm.sbatch run every launch this way; it is what
to give a scheduler (docs/launching.md). DeepSpeed's own runner, the ``deepspeed`` command, returns at once
on SIGTERM (143 on one node, 1 from its handler on several) while the ranks are still saving, and a signal
it has no handler for (SLURM's ``--signal=USR1`` to every process) kills it and ``launch.py`` with the
ranks' exit code uncollected. A scheduler that tears the job down when its main process returns (Kubernetes
after PID 1, SLURM after the batch script) then loses the checkpoint. The supervisor:

- runs the command as a child subreaper: a descendant orphaned by the runner's or launch.py's end is
  reparented here, and the supervisor returns only once every one of them has ended;
- turns any stop signal (SIGTERM, SIGINT, SIGHUP, SIGUSR1/2) into SIGTERM to the ranks themselves on one
  node (not to launch.py, which would SIGKILL them 30 s later; not to the runner, which would return), or to
  the runner on several nodes, whose handler stops every node's launch.py over pdsh;
- on several nodes also waits until rank 0, which may run on another host, gives up the output folder
  (reliability/run_lock.py);
- returns what the run recorded in ``run_exit.json`` where a signal ended the runner first: 75 when it
  was preempted and saved; otherwise the ranks' own code, as the runner passes it on;
- refuses, with one line and exit code 2, a run whose output folder a live run holds;
- with ``--max-restarts N``, reruns a failed run with ``--resume latest`` (reliability/restarts.py says
  which failures and how).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from eva_fastclip.reliability.preemption import PREEMPTED_EXIT_CODE
from eva_fastclip.reliability.restarts import (
    NOT_RESTARTED,
    cause,
    option,
    resumed_step,
    surviving_nodes,
    train_config,
    with_option,
)
from eva_fastclip.reliability.run_lock import held_message, live_holder, read_exit, running_ranks
from eva_fastclip.reliability.signals import STOP_SIGNALS

#: how long the run's processes may outlive its runner when no stop was asked for (a failed rank's peers)
GROUP_EXIT_S = 60.0
#: how long a stop's save may take before the supervisor gives up on it (a scheduler's grace ends first)
STOP_WAIT_S = 3600.0


def log(message: str) -> None:
    print(f"[supervisor {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Ended:
    code: int  # what the supervisor returns for this launch
    stopped: bool  # a stop signal reached the supervisor


def become_subreaper() -> bool:
    """Linux: orphaned descendants are reparented to this process, not to init (PR_SET_CHILD_SUBREAPER)."""
    if not sys.platform.startswith("linux"):
        return False
    pr_set_child_subreaper = 36
    return ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1) == 0


class Launch:
    """One run of ``command``: its processes, the stop passed on, the wait for all of them."""

    def __init__(self, command: list[str], output_dir: Path | None) -> None:
        self.command, self.output_dir = command, output_dir
        self.several_nodes = option(command, "--hostfile") is not None
        self.me = psutil.Process()
        self.before = {p.pid for p in self.me.children(recursive=True)}  # not this launch's (tests)
        self.started = time.time()
        self.stops: list[int] = []
        self.proc = subprocess.Popen(command, start_new_session=True)

    def descendants(self) -> list[psutil.Process]:
        """This launch's processes on this host still running (zombies reaped on the way)."""
        found = []
        for proc in self.me.children(recursive=True):
            if proc.pid in self.before:
                continue
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    if proc.pid != self.proc.pid and proc.ppid() == self.me.pid:
                        with contextlib.suppress(ChildProcessError):
                            os.waitpid(proc.pid, os.WNOHANG)
                    continue
            except psutil.NoSuchProcess:
                continue
            found.append(proc)
        return found

    def stop(self, signum: int, _frame=None) -> None:
        """A stop signal: SIGTERM to the ranks (one node) or to the runner (several nodes)."""
        if not self.stops:
            log(f"{signal.Signals(signum).name}: passing it on as SIGTERM; waiting for the ranks' save")
        self.stops.append(signum)
        if self.several_nodes and self.proc.poll() is None:
            targets = [psutil.Process(self.proc.pid)]
        else:
            every = self.descendants()
            launchers = {p.pid for p in every if _is_launcher(p)} | {self.proc.pid}
            targets = [p for p in every if p.pid not in launchers] or every  # none yet: all of it
        for proc in targets:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGTERM)

    def wait(self) -> Ended:
        previous = {sig: signal.signal(sig, self.stop) for sig in STOP_SIGNALS}
        try:
            code = self.proc.wait()
            self._wait_for_the_rest()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        code = 128 - code if code < 0 else code
        record = read_exit(self.output_dir, self.started) if self.output_dir is not None else None
        # the runner ended by a signal, or by its handler's 1 on several nodes: the ranks' own code
        overrides = record is not None and (record["code"] == PREEMPTED_EXIT_CODE or code > 128 or self.stops)
        if overrides and record["code"] != code:
            log(f"the runner ended with {code} ({cause(code)}); the run itself with {record['code']}")
            code = record["code"]
        return Ended(code, bool(self.stops))

    def _wait_for_the_rest(self) -> None:
        """Until every process of the launch on this host has ended and every rank (on any host) has left
        the output folder; SIGKILL for what outlives the runner by GROUP_EXIT_S when nothing asked a stop."""
        ended, told = time.monotonic(), False
        while True:
            alive, ranks = self.descendants(), self._ranks_present()
            if not alive and not ranks:
                return
            waited = time.monotonic() - ended
            if not self.stops and waited > GROUP_EXIT_S and alive:
                log(f"{len(alive)} process(es) alive {GROUP_EXIT_S:.0f} s after the runner ended: SIGKILL")
                for proc in alive:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        proc.kill()
            elif waited > STOP_WAIT_S:
                log(f"gave up waiting for the run's save after {STOP_WAIT_S:.0f} s")
                return
            elif not told and waited > 5:
                told = True
                where = "; ".join(rank.describe() for rank in ranks)
                log(f"waiting for {len(alive)} process(es) here and the ranks still in the run ({where})")
            time.sleep(0.2)

    def _ranks_present(self) -> list:
        """The ranks of this launch (on any host) still marked present in the output folder."""
        if self.output_dir is None:
            return []
        holder = live_holder(self.output_dir)
        rank0 = [holder] if holder is not None and holder.started >= self.started - 1 else []
        return [*rank0, *running_ranks(self.output_dir, self.started - 1)]


def _is_launcher(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return "deepspeed.launcher.launch" in proc.cmdline()
    return False


def _output_dir(command: list[str]) -> Path | None:
    cfg = train_config(command)
    return None if cfg is None else Path(cfg.train.output_dir)


def main(argv: list[str] | None = None, *, subreaper: bool = False) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eva_fastclip.reliability.supervisor", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--max-restarts", type=int, default=0, help="rerun a failed run up to N times")
    parser.add_argument("--min-nodes", type=int, default=1, help="restart while this many hosts answer")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the deepspeed command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.max_restarts < 0 or args.min_nodes < 1:
        parser.error("give MAX_RESTARTS >= 0, MIN_NODES >= 1 and the command after --")
    if subreaper and not become_subreaper():
        log("not Linux: processes orphaned by the runner are not waited for")
    output_dir = _output_dir(command)
    holder = live_holder(output_dir) if output_dir is not None else None
    if holder is not None:
        log(held_message(output_dir, holder))
        return 2
    restarts = 0
    while True:
        started = time.monotonic()
        ended = Launch(command, output_dir).wait()
        code = ended.code
        if code == 0:
            return 0
        if not args.max_restarts:
            log(f"the run exited with code {code}: {NOT_RESTARTED.get(code, cause(code))}")
            return code
        if code in NOT_RESTARTED or ended.stopped:
            why = NOT_RESTARTED.get(code, "a stop was asked for")
            log(f"the run exited with code {code}: {why}; not restarted")
            return code
        if restarts >= args.max_restarts:
            log(f"the run exited with code {code} ({cause(code)}) after {restarts} restart(s): no more")
            return code
        next_command = surviving_nodes(command, args.min_nodes)
        if next_command is None:
            return code
        restarts += 1
        command = with_option(next_command, "--resume", "latest")
        took = time.monotonic() - started
        log(
            f"restart {restarts} of {args.max_restarts}: the run exited with code {code} ({cause(code)}) "
            f"after {took:.0f} s; resuming from {resumed_step(command)}: {shlex.join(command)}"
        )


if __name__ == "__main__":
    raise SystemExit(main(subreaper=True))
