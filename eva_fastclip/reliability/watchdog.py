"""No silent hang: a thread that ends a rank which has spent longer than its allowance in one phase.

gloo and NCCL wait 30 minutes for a collective by default (DeepSpeed passes that to NCCL too), and a rank
waiting for a stopped peer says nothing meanwhile. The trainer names what it is doing (:meth:`phase`:
start-up, loader, forward, loss, backward, optimizer step, evaluation, save, ...); each phase has an
allowance, ``train.hang_timeout_s`` for the work of a step and a batch from the loader,
``train.hang_timeout_long_s`` for start-up (process group, model, engine, a checkpoint's load), the first
step, evaluations and saves. When a phase outlasts its allowance the rank logs what it was doing (step, phase,
the last collective its loss entered), which ranks it is waiting for (below) and the stacks of its threads,
marks the run aborted in the store and exits with :data:`HANG_EXIT_CODE`. Every rank's guardian
(reliability/guardian.py, a process of its own) then SIGKILLs its rank, a stopped one included, so every
node's launch.py exits non-zero and the ``deepspeed`` command returns.

Which ranks: every rank writes a heartbeat (a count, its step and phase) to the process group's store every
:data:`HEARTBEAT_S` seconds over a connection of its own. A hang report reads them twice, a local interval
apart: a rank whose count did not move is stopped or gone, one that never wrote one is named as such, one
whose step is behind is the one the others wait for. A store that does not answer means rank 0, which
serves it, is stopped or gone. No decision compares two hosts' clocks. With NCCL, PyTorch's Flight
Recorder records the collectives, and the watchdog dumps it beside the run (``flight_recorder/``) before
exiting.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from eva_fastclip.reliability.store import store_client

if TYPE_CHECKING:
    from eva_fastclip.config import TrainConfig

log = logging.getLogger(__name__)

#: the exit code of a rank the watchdog ended (the ``timeout`` command's)
HANG_EXIT_CODE = 124
HEARTBEAT_S = 2.0
#: how long a hang report watches the others' heartbeat counts (this host's clock): a count that does not
#: move in it belongs to a rank that is stopped or gone
PEER_WATCH_S = 2.5 * HEARTBEAT_S
LONG_PHASES = ("start-up", "first step", "evaluation", "save", "finish")


class Watchdog:
    """Within ``with Watchdog(...)``: ends the process when a phase outlasts its allowance (0: off)."""

    def __init__(
        self,
        timeout_s: float,
        long_timeout_s: float,
        *,
        rank: int = 0,
        world_size: int = 1,
        describe: Callable[[], str] = lambda: "",
        dump_dir: Path | None = None,
    ) -> None:
        self.timeout_s, self.long_timeout_s = timeout_s, long_timeout_s
        self.rank, self.world_size = rank, world_size
        self.describe = describe  # more about what the rank is doing (the last collective, the loader)
        self.dump_dir = dump_dir
        self.step = 0
        self._state = ("start-up", time.monotonic())  # (phase, since): one attribute, read by the thread
        self._store_address: tuple[str, int] | None = None
        self._store = None
        self._seq = 0  # heartbeats written: what the others watch move
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._guardian = None  # reliability/guardian.py: ends this rank if it is stopped when the run ends

    @classmethod
    def for_run(cls, train: TrainConfig) -> Watchdog:
        """The watchdog of a rank of the run ``train`` configures: its allowances, the Flight Recorder's
        folder in its output folder, the rank and world size its launcher gives (the store connects once
        the process group is up: :meth:`connect_store`)."""
        return cls(
            train.hang_timeout_s,
            train.hang_timeout_long_s,
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            dump_dir=Path(train.output_dir) / "flight_recorder",
        )

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def flight_recorder_env(self) -> dict[str, str]:
        return flight_recorder_env(self.dump_dir) if self.dump_dir is not None else {}

    def __enter__(self) -> Watchdog:
        if self.enabled:
            self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._guardian is not None:
            self._guardian.kill()
            self._guardian.wait()

    # ---- what the rank is doing ---------------------------------------------------------------------

    def set_phase(self, name: str, step: int | None = None) -> None:
        """The rank does ``name`` from now on (at optimizer step ``step`` + 1, where given)."""
        if step is not None:
            self.step = step
        self._state = (name, time.monotonic())

    @contextmanager
    def phase(self, name: str, step: int | None = None):
        """A phase inside another (an evaluation or a save between steps, the wait for a loader): the
        outer one resumes after. ``step`` as for :meth:`set_phase`."""
        outer = self._state[0]
        self.set_phase(name, step)
        try:
            yield
        finally:
            self.set_phase(outer)

    def allowance(self, phase: str) -> float:
        """The long allowance for start-up, evaluations, saves and all of the first step (kernels compile,
        the allocator and the loader's workers warm up), the short one for the rest."""
        return self.long_timeout_s if phase in LONG_PHASES or self.step == 0 else self.timeout_s

    def connect_store(self, host: str, port: int) -> None:
        """Heartbeats from now on, through a connection of this thread's own to the group's store, and
        the rank's guardian (reliability/guardian.py)."""
        self._store_address = (host, port)
        # once per process: eva-fastclip tune builds a Trainer per probe, each connecting again
        if self.enabled and self.world_size > 1 and self._thread is not None and self._guardian is None:
            from eva_fastclip.reliability.guardian import start_guardian

            self._guardian = start_guardian(os.getpid(), self.rank, host, port, self.timeout_s)

    # ---- the thread -----------------------------------------------------------------------------------

    def _watch(self) -> None:
        next_beat = 0.0
        while not self._stop.wait(0.5):
            now = time.monotonic()
            phase, since = self._state
            if now - since > self.allowance(phase):
                self._fire(phase, now - since)
                return
            if now >= next_beat and self._store_address is not None:
                next_beat = now + HEARTBEAT_S
                self._beat(phase, now - since)

    def _client(self):
        if self._store is None:
            self._store = store_client(*self._store_address)
        return self._store

    def _beat(self, phase: str, seconds: float) -> None:
        self._seq += 1
        record = {"seq": self._seq, "step": self.step, "phase": phase, "in_phase_s": round(seconds, 1),
                  "host": socket.gethostname(), "pid": os.getpid()}  # fmt: skip
        try:
            self._client().set(f"eva_fastclip/heartbeat/{self.rank}", json.dumps(record))
        except Exception:  # a store that does not answer: the report says so when it matters
            self._store = None

    def _heartbeats(self) -> dict[int, dict]:
        """Every rank's last heartbeat in the store, of those that wrote one (a missing key is not waited
        for: it is checked first, so a rank that never beat cannot stall the read)."""
        store, beats = self._client(), {}
        for r in range(self.world_size):
            key = f"eva_fastclip/heartbeat/{r}"
            if store.check([key]):
                beats[r] = json.loads(store.get(key))
        return beats

    def _peers(self) -> str:
        """Which ranks this one waits for, from their heartbeats read twice :data:`PEER_WATCH_S` apart by
        this host's monotonic clock: a rank whose count did not move meanwhile is stopped or gone. No two
        hosts' clocks are compared (they may differ by seconds)."""
        if self._store_address is None or self.world_size == 1:
            return ""
        try:
            first = self._heartbeats()
            deadline = time.monotonic() + PEER_WATCH_S
            while (left := deadline - time.monotonic()) > 0:  # beating on: the others' reports watch it
                time.sleep(min(left, HEARTBEAT_S))
                phase, since = self._state
                self._beat(phase, time.monotonic() - since)
            beats = self._heartbeats()
        except Exception as err:  # rank 0 serves the store: stopped or gone
            host = self._store_address[0]
            return f"; the store on rank 0 ({host}) does not answer ({err}): rank 0 is stopped or gone"
        mine = (self.step, self._state[0])
        others = [r for r in range(self.world_size) if r != self.rank]
        never = [r for r in others if r not in beats]
        stale = [r for r in others if r in beats and first.get(r, {}).get("seq") == beats[r]["seq"]]
        behind = [r for r in others if r in beats and beats[r]["step"] < self.step and r not in stale]
        elsewhere = [
            r for r in others
            if r in beats and r not in stale + behind and (beats[r]["step"], beats[r]["phase"]) != mine
        ]  # fmt: skip
        groups = (
            (f"no heartbeat in {PEER_WATCH_S:.0f} s (stopped or gone)", stale),
            ("behind, at an earlier step", behind),
            ("in another phase", elsewhere),
        )
        lines = [
            f"{label}: {', '.join(_described(r, beats[r]) for r in ranks)}"
            for label, ranks in groups
            if ranks
        ]
        if never:
            lines.append(f"no heartbeat ever (never started, or stopped before its first): ranks {never}")
        return "; waiting for ranks " + "; ".join(lines) if lines else "; every rank's heartbeat is current"

    def _fire(self, phase: str, seconds: float) -> None:
        detail = self.describe()
        message = (
            f"rank {self.rank} ({socket.gethostname()}, pid {os.getpid()}): no progress for {seconds:.0f} s "
            f"in phase '{phase}' at step {self.step + (phase != 'start-up')} (allowance "
            f"{self.allowance(phase):.0f} s)"
            f"{'; ' + detail if detail else ''}{self._peers()}. The stacks of its threads follow; it exits "
            f"with code {HANG_EXIT_CODE}"
        )
        log.error("%s", message)
        dumped = _dump_flight_recorder(self.dump_dir, self.rank)
        if dumped:
            log.error("PyTorch's Flight Recorder (the collectives in flight): %s", dumped)
        for handler in logging.getLogger().handlers:
            handler.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        # the other ranks' guardians end theirs, stopped ones included (this one's first: it exits itself)
        self._abort(f"rank {self.rank} ({socket.gethostname()}) ended a hang in phase '{phase}'")
        _kill_children()  # a stopped loader worker would never notice its rank gone
        os._exit(HANG_EXIT_CODE)

    def _abort(self, why: str) -> None:
        from eva_fastclip.reliability.store import ABORT_KEY, POLL_S

        if self._guardian is not None:
            self._guardian.kill()
        if self._store_address is not None:
            with contextlib.suppress(Exception):  # a store that does not answer: its guardians see that
                self._client().set(ABORT_KEY, why)
                if self.rank == 0:  # it serves the store: the guardians read the mark before it goes
                    time.sleep(2 * POLL_S)


def _kill_children() -> None:
    """SIGKILL this process's descendants (its loader workers): the launcher cannot reach them once their
    rank is gone, and a stopped one would stay."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()


def _described(rank: int, beat: dict) -> str:
    return (
        f"rank {rank} ({beat['host']}, pid {beat['pid']}: step {beat['step']}, {beat['phase']} for "
        f"{beat['in_phase_s']:.0f} s, heartbeat {beat['seq']})"
    )


def flight_recorder_env(dump_dir: Path) -> dict[str, str]:
    """The environment that switches PyTorch's Flight Recorder on for NCCL (set before the process group
    starts; a user's own settings win): a ring buffer of the last collectives, dumped on an NCCL timeout
    into ``dump_dir``."""
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(dump_dir / "rank_"),
    }


def _dump_flight_recorder(dump_dir: Path | None, rank: int) -> str | None:
    """The Flight Recorder's record of this rank's collectives, written on a hang (NCCL only)."""
    if dump_dir is None:
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        trace = torch._C._distributed_c10d._dump_nccl_trace()
    except Exception:  # no NCCL, or a PyTorch without the recorder: nothing to dump
        return None
    dump_dir.mkdir(parents=True, exist_ok=True)
    path = dump_dir / f"rank_{rank}.pkl"
    path.write_bytes(trace)
    return str(path)
