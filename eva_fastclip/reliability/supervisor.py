"""The command a scheduler runs: ``deepspeed`` under a supervisor that returns only after the run's save.

    python -m eva_fastclip.reliability.supervisor [--max-restarts N] [--min-nodes M] -- \
        deepspeed ... --module eva_fastclip train --config C ...

launchers/single_node.sh, multi_node.sh, demo.sh and slurm.sbatch run every launch this way; it is what
to give a scheduler (docs/launching.md). DeepSpeed's own runner, the ``deepspeed`` command, returns at once
on SIGTERM (143 on one node, 1 from its handler on several) while the ranks are still saving, and a signal
it has no handler for (SIGUSR1 to every process of a job) kills it and ``launch.py`` with the ranks' exit
code uncollected. A scheduler that tears the job down when its main process returns (Kubernetes after
PID 1, SLURM after the batch script) then loses the checkpoint. The supervisor:

- handles the stop signals from its start (as PID 1 of a container nothing else would) and turns each
  (SIGTERM, SIGINT, SIGHUP, SIGUSR1/2) into SIGTERM to the ranks themselves where launch.py runs on its
  host (not to launch.py, which would SIGKILL them 30 s later; not to the runner, which would return), else
  to the runner, whose handler stops every node's launch.py over pdsh (its 30 s then apply);
- runs the command as a child subreaper: a descendant orphaned by the runner's or launch.py's end is
  reparented here, and the supervisor returns only once every one of them has ended, and every rank, on
  any host, has left the output folder (reliability/run_lock.py);
- returns the code the run recorded in ``run_exit.json`` where a signal ended the runner first (or the
  runner returned 0 for a killed launch.py): 75 when it was preempted and saved; otherwise the ranks' own
  code, as the runner passes it on;
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
    resumed_step,
    surviving_nodes,
    train_config,
    with_option,
)
from eva_fastclip.reliability.run_lock import (
    STALE_S,
    BeatWatch,
    held_here,
    held_message,
    live_holder,
    marks,
    read_exit,
    running_ranks,
)
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


class Stops:
    """The stop signals this process got: handled from the start of main(), before the first launch and
    between restarts, and passed on to the launch under way."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.launch: Launch | None = None

    def __call__(self, signum: int, _frame=None) -> None:
        if not self.signals:
            log(f"{signal.Signals(signum).name}: passing it on as SIGTERM; waiting for the ranks' save")
        self.signals.append(signum)
        if self.launch is not None:
            self.launch.pass_stop()


class Launch:
    """One run of ``command``: its processes, the stop passed on, the wait for all of them."""

    def __init__(self, command: list[str], output_dir: Path | None, stops: Stops) -> None:
        self.command, self.output_dir, self.stops = command, output_dir, stops
        self.me = psutil.Process()
        self.before = {p.pid for p in self.me.children(recursive=True)}  # not this launch's (tests)
        self.beats = BeatWatch()  # the marks of other hosts live while their beat counts move
        # what an earlier run left: its marks are not waited for, its exit record is not this launch's
        self.earlier = {h.identity for h in marks(output_dir)} if output_dir is not None else set()
        self.exit_before = read_exit(output_dir) if output_dir is not None else None
        self.proc = subprocess.Popen(command, start_new_session=True)
        stops.launch = self
        if stops.signals:  # asked before the launch began
            self.pass_stop()

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

    def pass_stop(self) -> None:
        """SIGTERM to the ranks where launch.py runs here (one node); else to the runner, whose handler
        stops every node's launch.py over pdsh (a hostfile: the ranks are not this process's descendants)."""
        every = self.descendants()
        launchers = [p for p in every if _is_launcher(p)]
        if not launchers and self.proc.poll() is None:
            targets = [p for p in every if p.pid == self.proc.pid]
        else:
            skip = {p.pid for p in launchers} | {self.proc.pid}
            targets = [p for p in every if p.pid not in skip] or every  # none yet: all of it
        for proc in targets:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGTERM)

    def wait(self) -> Ended:
        while (code := self.proc.poll()) is None:  # polled: a signal's handler may poll it too
            time.sleep(0.2)
        self._wait_for_the_rest()
        self.stops.launch = None
        code = 128 - code if code < 0 else code
        record = read_exit(self.output_dir) if self.output_dir is not None else None
        record = None if record == self.exit_before else record
        # a signal ended the runner (or its handler's 1 on several nodes), or its launch.py was killed
        # and it returned 0: the ranks' own code
        overrides = record is not None and (
            record["code"] == PREEMPTED_EXIT_CODE or code > 128 or self.stops.signals or code == 0
        )
        if overrides and record["code"] != code:
            log(f"the runner ended with {code} ({cause(code)}); the run itself with {record['code']}")
            code = record["code"]
        if code != 0:  # what the run said of its end (the ranks' own output may be lost with pdsh)
            said = f"{record['code']}: {record.get('detail') or 'no detail'}" if record else "none written"
            log(f"the run's own record of its exit: {said}")
        return Ended(code, bool(self.stops.signals))

    def _wait_for_the_rest(self) -> None:
        """Until every process of the launch on this host has ended and every rank (on any host) has left
        the output folder. What outlives the runner by GROUP_EXIT_S here is SIGKILLed once no rank is
        saving (or at once where nothing asked a stop); the wait ends after STOP_WAIT_S with a save in
        flight, GROUP_EXIT_S + STALE_S without."""
        ended, killed, told = time.monotonic(), None, False
        while True:
            alive, ranks = self.descendants(), self._ranks_present()
            if not alive and not ranks:
                return
            now = time.monotonic()
            waited = now - ended
            patience = STOP_WAIT_S if self.stops.signals else GROUP_EXIT_S + STALE_S
            if waited > patience or (killed is not None and now - killed > 10):
                log(f"gave up waiting for {len(alive)} process(es) here and {len(ranks)} rank(s) anywhere")
                return
            if killed is None and alive and waited > GROUP_EXIT_S and not (ranks and self.stops.signals):
                log(f"{len(alive)} process(es) alive {GROUP_EXIT_S:.0f} s after the runner ended: SIGKILL")
                for proc in alive:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        proc.kill()
                killed = now
            elif not told and waited > 5:
                told = True
                where = "; ".join(rank.describe() for rank in ranks)
                log(f"waiting for {len(alive)} process(es) here and the ranks still in the run ({where})")
            time.sleep(0.2)

    def _ranks_present(self) -> list:
        """The ranks of this launch (on any host) still marked present in the output folder: those not
        there before it began (no clock is compared: a rank's mark is timed by its own host's)."""
        return [h for h in self._live_marks() if h.identity not in self.earlier]

    def _live_marks(self) -> list:
        """The output folder's live lock and rank marks."""
        if self.output_dir is None:
            return []
        found = [live_holder(self.output_dir, self.beats), *running_ranks(self.output_dir, self.beats)]
        return [mark for mark in found if mark is not None]


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
    holder = held_here(output_dir) if output_dir is not None else None
    if holder is not None:  # (one on another host: rank 0 decides, after watching its heartbeat)
        log(held_message(output_dir, holder))
        return 2
    stops = Stops()
    previous = {sig: signal.signal(sig, stops) for sig in STOP_SIGNALS}  # as PID 1: no default actions
    try:
        return _supervise(command, output_dir, stops, args.max_restarts, args.min_nodes)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(command: list[str], output_dir: Path | None, stops: Stops, max_restarts: int, min_nodes: int):
    restarts = 0
    while True:
        started = time.monotonic()
        ended = Launch(command, output_dir, stops).wait()
        code = ended.code
        if code == 0:
            return 0
        if not max_restarts:
            log(f"the run exited with code {code}: {NOT_RESTARTED.get(code, cause(code))}")
            return code
        if code in NOT_RESTARTED or ended.stopped:
            why = NOT_RESTARTED.get(code, "a stop was asked for")
            log(f"the run exited with code {code}: {why}; not restarted")
            return code
        if restarts >= max_restarts:
            log(f"the run exited with code {code} ({cause(code)}) after {restarts} restart(s): no more")
            return code
        next_command = surviving_nodes(command, min_nodes)
        if next_command is None:
            return code
        if stops.signals:  # asked while the hosts were probed
            log(f"the run exited with code {code}: a stop was asked for; not restarted")
            return code
        restarts += 1
        command = with_option(next_command, "--resume", "latest")
        took = time.monotonic() - started
        log(
            f"restart {restarts} of {max_restarts}: the run exited with code {code} ({cause(code)}) "
            f"after {took:.0f} s; resuming from {resumed_step(command)}: {shlex.join(command)}"
        )


if __name__ == "__main__":
    raise SystemExit(main(subreaper=True))
