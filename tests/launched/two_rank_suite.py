"""One 2-rank launch for the deterministic programs of several test modules: each a *piece* that every rank
runs in one process group, one piece after another, writing its files for the tests to read. Only N ranks
matter to them (no signal, launcher or exit path is under test), and one launch through the rank pool costs
seconds where one process group each cost a launch or a ``torch.multiprocessing.spawn`` of re-imports each.

As a program (the ranks; through the rank pool, or by hand ``deepspeed --num_gpus 2
tests/launched/two_rank_suite.py OUT PIECE...``): each rank runs the named pieces in PIECES' order, each
into OUT/PIECE/, marking ``started_rank<K>`` before and ``ok_rank<K>`` after (its wall and CPU seconds in
the rank); a piece that raises on a rank leaves ``error_rank<K>.txt`` (its traceback) and ends that rank,
since the other may be waiting for it in a collective. The group then ends (the pool stops every rank once
one fails).

As a library (the session fixture ``two_rank_suite`` of tests/launched/conftest.py): :class:`Suite` launches
the pieces the session's tests read, and after a launch that ended early launches the pieces not yet run
again, so one piece's failure (an error, a crash, a hang past PIECE_TIMEOUT_S) fails only the tests that
read it. Pieces do not depend on each other: each builds what it compares from seeds (every Trainer seeds
the generators) and reads nothing another wrote.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import traceback
from pathlib import Path

#: piece -> "module:function" (a module of tests/ or tests/launched/), run with the piece's folder on every
#: rank, in this order: the host-memory check before the process group exists (joining it changes malloc's
#: settings), the probe that runs out of memory last (its clean-up destroys every DeepSpeed engine the
#: process still holds)
PIECES = {
    "host_memory": "test_engine_setup_two_ranks:large_blocks",
    "hardware": "test_engine_setup_two_ranks:agree_on_hardware",
    "preflight_error": "test_engine_setup_two_ranks:preflight_error",
    "remote_data": "test_remote_two_ranks:remote_runs",
    "data_wait": "test_data_wait_two_ranks:slowest_rank_of_two",
    "compositional": "test_compositional_distributed:two_ranks",
    "siglip": "test_siglip_two_ranks:two_ranks",
    "siglip_toy": "test_siglip_two_ranks:toy_run",
    "lamb_zero": "test_lamb_zero_two_ranks:two_ranks",
    "accumulation": "accumulation_ranks:two_ranks",
    "cached_step": "cached_step_ranks:two_ranks",
    "compiled": "test_compiled_two_ranks:compiled",
    "loss_benchmark": "test_bench_loss_ranks:two_ranks",
    "tune_out_of_memory": "test_tune_two_ranks:agree_out_of_memory",
}
#: pieces that run before the ranks join the process group
BEFORE_THE_GROUP = ("host_memory",)
#: a piece still running after this long is taken for hung: the group is killed, the rest launched again
PIECE_TIMEOUT_S = 600.0
RANKS = 2
PROGRAM = str(Path(__file__).resolve())


# ---- the ranks ---------------------------------------------------------------------------------------


def run_pieces(out: Path, pieces: list[str]) -> None:
    from eva_fastclip.reliability.process import init_process_group

    rank = int(os.environ["RANK"])
    joined = False
    for name in pieces:
        if name not in BEFORE_THE_GROUP and not joined:
            init_process_group()  # as every Trainer joins it (reliability/process.py)
            joined = True
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"started_rank{rank}").touch()
        wall, cpu = time.monotonic(), time.process_time()
        try:
            module, function = PIECES[name].split(":")
            getattr(importlib.import_module(module), function)(folder)
        except BaseException:
            (folder / f"error_rank{rank}.txt").write_text(traceback.format_exc())
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # the other rank may wait for this one in a collective: the group ends
        took = f"{time.monotonic() - wall:.1f} s, {time.process_time() - cpu:.1f} s CPU\n"
        (folder / f"ok_rank{rank}").write_text(took)


# ---- the fixture's side ------------------------------------------------------------------------------


class PieceFailed(Exception):
    pass


class Suite:
    """The pieces' results: ``suite(piece)`` is the piece's folder, once every rank finished it; a piece that
    failed raises PieceFailed with what its ranks reported. The launch happens at the first call."""

    def __init__(self, pool, out: Path, wanted: set[str]) -> None:
        unknown = wanted - PIECES.keys()
        if unknown:
            raise ValueError(f"no such pieces: {sorted(unknown)} (two_rank_suite.PIECES)")
        self.pool, self.out, self.wanted = pool, out, wanted
        self.folders: dict[str, Path] = {}
        self.errors: dict[str, str] = {}
        self.launches = 0

    def __call__(self, piece: str) -> Path:
        if piece not in self.folders and piece not in self.errors:
            self._run([p for p in PIECES if p in self.wanted | {piece} and p not in self.folders])
        if piece in self.errors:
            raise PieceFailed(f"two_rank_suite piece {piece!r} failed:\n{self.errors[piece]}")
        return self.folders[piece]

    def _run(self, left: list[str]) -> None:
        while left:
            self.launches += 1
            out = self.out / f"launch{self.launches}"
            out.mkdir(parents=True)
            log = out / "ranks.log"
            group = self.pool.launch(RANKS, [PROGRAM, str(out), *left], log=log, grace_s=5.0)
            hung = self._wait(group, out, left)
            left = self._collect(group, out, left, hung)

    def _wait(self, group, out: Path, pieces: list[str]) -> str | None:
        """Until the group ends; the piece it was killed in, if one ran past PIECE_TIMEOUT_S."""
        while True:
            try:
                group.wait(timeout=5)
                return None
            except TimeoutError:
                pass
            running = [p for p in pieces if _state(out / p) == "running"]
            if running:
                started = min(f.stat().st_mtime for f in (out / running[0]).glob("started_rank*"))
                if time.time() - started > PIECE_TIMEOUT_S:
                    group.kill()
                    return running[0]

    def _collect(self, group, out: Path, pieces: list[str], hung: str | None) -> list[str]:
        """Record what the launch finished; returns the pieces to launch again."""
        tail = group.output()[-6000:]
        failed_before = False
        for i, piece in enumerate(pieces):
            folder, state = out / piece, _state(out / piece)
            if state == "ok":
                self.folders[piece] = folder
            elif state == "error":
                self.errors[piece] = "\n".join(
                    f"rank {p.stem[-1]}: {p.read_text()}" for p in sorted(folder.glob("error_rank*.txt"))
                )
                failed_before = True
            elif state == "running" and not failed_before:  # it ended the launch: a crash or a hang
                why = f"hung: still running after {PIECE_TIMEOUT_S:.0f} s" if piece == hung else "crashed"
                self.errors[piece] = f"{why} (exit codes {group.codes}); the ranks' output ends:\n{tail}"
                return pieces[i + 1 :]
            elif state == "not started" and not failed_before:  # the launch failed before any piece
                for name in pieces[i:]:
                    self.errors[name] = f"not run (exit codes {group.codes}); the ranks' output ends:\n{tail}"
                return []
            else:  # stopped by an earlier piece's failure
                return pieces[i:]
        return []


def _state(folder: Path) -> str:
    if list(folder.glob("error_rank*.txt")):
        return "error"
    if len(list(folder.glob("ok_rank*"))) == RANKS:
        return "ok"
    return "running" if list(folder.glob("started_rank*")) else "not started"


if __name__ == "__main__":
    sys.path.insert(1, str(Path(__file__).parents[1]))  # the helpers of tests/ (this folder is sys.path[0])
    sys.path.insert(2, str(Path(__file__).parents[2]))  # the repository's benchmarks/
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher's own argument
    run_pieces(Path(args[0]), args[1:])
