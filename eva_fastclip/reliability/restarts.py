"""What a restart decides: which failures are restarted, the step a restart goes on from, the hosts left.

``MAX_RESTARTS=N`` for the launchers runs the launch supervisor (reliability/supervisor.py) with
``--max-restarts N``: when the run fails, it runs it again with ``--resume latest``, up to N times, logging
one line per restart: the exit code and what it means, and the step the run goes on from. Not restarted:
success, a configuration error (2: it would fail the same way), too many non-finite steps (3: the same data
gives the same steps again), a checkpoint that could not be written (4: the disk is still full), a
preemption (75: the scheduler requeues it) and a stop asked of the supervisor (SIGTERM, Ctrl-C: passed on to
the run, which saves and exits; docs/reliability.md).

With ``--hostfile`` in the command (multi_node.sh), each host is probed over ssh before a restart
(DeepSpeed reaches them the same way); those that do not answer are left out of a hostfile written beside
the original (``<hostfile>.live``), and the run goes on with the rest when at least ``--min-nodes``
remain. A lost first host hands ``--master_addr`` to the first one left. The global batch and every sample
once an epoch hold across the change of rank count (docs/checkpoints.md).

Why a loop around ``deepspeed`` and not torch elastic's agent: runs start with ``deepspeed --hostfile``
(pdsh over ssh, one launch.py a node), which the agent does not drive, and DeepSpeed's own elastic
training is broken on torch 2.x; the loop keeps that launch and adds only the restart.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

#: exit codes that a restart would not cure, and what they mean
NOT_RESTARTED = {
    2: "a configuration or input error",
    3: "too many non-finite steps in a row",
    4: "a checkpoint could not be written",
    75: "preempted (resumable: the scheduler requeues it)",
}
#: what the other failures usually mean (the ranks' own codes pass through launch.py and pdsh)
CAUSES = {1: "a rank failed", 124: "a hang (a rank's watchdog)", 255: "a node lost (ssh ended)"}
PROBE_TIMEOUT_S = 10


def log(message: str) -> None:
    print(f"[supervisor {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cause(code: int) -> str:
    if code < 0 or code > 128:  # a signal: -N from Python, 128+N from a shell, 256-N from sys.exit(-N)
        number = -code if code < 0 else code - 128 if code < 192 else 256 - code
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = str(number)
        return CAUSES.get(code, f"killed by signal {name}")
    return CAUSES.get(code, NOT_RESTARTED.get(code, "a failure"))


def option(command: list[str], name: str) -> str | None:
    """The value of ``name`` in ``command`` (``--name value`` or ``--name=value``), else None."""
    for i, arg in enumerate(command):
        if arg == name and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def with_option(command: list[str], name: str, value: str) -> list[str]:
    """``command`` with ``name`` set to ``value`` (replaced where it is, appended otherwise)."""
    out, i, replaced = [], 0, False
    while i < len(command):
        if command[i] == name and i + 1 < len(command):
            out += [name, value]
            i, replaced = i + 2, True
            continue
        if command[i].startswith(name + "="):
            out.append(f"{name}={value}")
            replaced = True
        else:
            out.append(command[i])
        i += 1
    return out if replaced else [*out, name, value]


def train_config(command: list[str]):
    """The config of the ``train`` command in ``command`` (its ``--config`` and ``--set``s), or None where
    there is none or it does not load (the run itself says what is wrong)."""
    from eva_fastclip.config import load_config

    train = command[command.index("train") + 1 :] if "train" in command else []
    if option(train, "--config") is None:
        return None
    try:
        return load_config(option(train, "--config"), _overrides(train))
    except Exception:  # noqa: BLE001
        return None


def resumed_step(command: list[str]) -> str:
    """The step ``--resume latest`` goes on from: the last complete checkpoint of the run's output folder."""
    from eva_fastclip.checkpointing import checkpoint

    cfg = train_config(command)
    if cfg is None:
        return "the last complete checkpoint (the config is not read here)"
    try:
        latest = checkpoint.resolve_resume("latest", Path(cfg.train.output_dir) / "checkpoints")
    except Exception as err:  # noqa: BLE001 (the run itself will say what is wrong)
        return f"the last complete checkpoint (not read here: {err})"
    if latest is None:
        return "step 0 (no complete checkpoint yet)"
    return f"step {checkpoint.read_marker(latest)['step']} ({latest})"


def _overrides(args: list[str]) -> list[str]:
    """The ``K=V`` of every ``--set K=V`` and ``--set=K=V`` (argparse takes both) in ``args``, in the
    command's order: the last of a key wins."""
    overrides = []
    for i, arg in enumerate(args):
        if arg == "--set" and i + 1 < len(args):
            overrides.append(args[i + 1])
        elif arg.startswith("--set="):
            overrides.append(arg.split("=", 1)[1])
    return overrides


def ssh_options(command: list[str]) -> list[str]:
    """The options DeepSpeed's runner gives ssh for ``command``: ``--ssh_port`` and the user's
    ``PDSH_SSH_ARGS_APPEND`` (what pdsh passes on to ssh)."""
    import os
    import shlex

    options = shlex.split(os.environ.get("PDSH_SSH_ARGS_APPEND", ""))
    port = option(command, "--ssh_port")
    return [*options, "-p", port] if port else options


def answering_hosts(hostfile: Path, options: list[str] = ()) -> tuple[list[str], list[str]]:
    """The hostfile's lines whose host answers ssh (with ``options``: ssh_options), and the hosts that do
    not."""
    live, lost = [], []
    for line in hostfile.read_text().splitlines():
        host = line.split("#", 1)[0].split()
        if not host:
            continue
        probe = [
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            f"ConnectTimeout={PROBE_TIMEOUT_S}",
            *options,
            host[0],
            "true",
        ]
        try:
            ok = subprocess.run(probe, capture_output=True, timeout=PROBE_TIMEOUT_S + 5).returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
        (live if ok else lost).append(line if ok else host[0])
    return live, lost


def surviving_nodes(command: list[str], min_nodes: int) -> list[str] | None:
    """``command`` for the hosts that still answer, or None when fewer than ``min_nodes`` do."""
    hostfile = option(command, "--hostfile")
    if hostfile is None:
        return command
    live, lost = answering_hosts(Path(hostfile), ssh_options(command))
    if not lost:
        return command
    if len(live) < min_nodes:
        log(f"hosts {', '.join(lost)} do not answer ssh; {len(live)} left, fewer than MIN_NODES={min_nodes}")
        return None
    live_file = Path(hostfile).with_name(Path(hostfile).name.removesuffix(".live") + ".live")
    live_file.write_text("\n".join(live) + "\n")
    log(f"hosts {', '.join(lost)} do not answer ssh: going on with {len(live)} ({live_file})")
    command = with_option(command, "--hostfile", str(live_file))
    if len(live) == 1 and "--force_multi" not in command:  # else DeepSpeed runs one host's share here
        at = next(i for i, arg in enumerate(command) if arg.split("=")[0] == "--hostfile")
        command.insert(at, "--force_multi")
    master = option(command, "--master_addr")
    if master is not None and is_lost(master, lost):
        first = live[0].split()[0]
        log(f"--master_addr {master} is lost: rank 0 moves to {first}")
        command = with_option(command, "--master_addr", first)
    return command


def is_lost(master: str, lost: list[str]) -> bool:
    """Whether ``--master_addr`` (a host's name, or one of its addresses) is one of the ``lost`` hosts:
    compared by name, then by the addresses each name resolves to."""
    if master in lost:
        return True
    addresses = _addresses(master)
    return any(addresses & _addresses(host) for host in lost)


def _addresses(host: str) -> set[str]:
    import socket

    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:  # a lost host's name may resolve no more: its name alone then
        return set()
