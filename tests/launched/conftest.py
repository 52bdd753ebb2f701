"""Runs that tests in several modules of tests/launched read: each started once per session.

- ``uninterrupted``: the fault tests' run (launched/fault_runs.py) to its end on 2 ranks of the rank pool,
  logging every 5 steps: the reference that test_preemption's preempted and resumed run must end at, and
  the clean run in which test_straggler_runs finds no straggler. No watchdog (nothing here hangs).
- ``two_rank_suite``: one 2-rank launch of the deterministic programs of several modules
  (launched/two_rank_suite.py), the pieces that the session's tests name in their module's
  ``TWO_RANK_PIECES``; ``two_rank_suite(piece)`` is a piece's folder of results, or fails with its error.
"""

from dataclasses import dataclass
from pathlib import Path

import pytest
from fault_runs import MODULE, fault_args
from launching import run_ranks


@dataclass(frozen=True)
class Finished:
    out: Path  # its train.output_dir
    output: str  # what its ranks wrote


@pytest.fixture(scope="session")
def uninterrupted(rank_pool, toy_data, tmp_path_factory) -> Finished:
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    args = fault_args(toy_data, out, "train.log_every_steps=5", "train.hang_timeout_s=0")
    output = run_ranks(2, [*MODULE, *args], out.parent / "run.log", pool=rank_pool)
    return Finished(out, output)


@pytest.fixture(scope="session")
def two_rank_suite(request, rank_pool, tmp_path_factory):
    from two_rank_suite import PieceFailed, Suite

    wanted = {
        piece
        for item in request.session.items
        if "two_rank_suite" in item.fixturenames
        for piece in getattr(item.module, "TWO_RANK_PIECES", ())
    }
    suite = Suite(rank_pool, tmp_path_factory.mktemp("two_rank_suite"), wanted)

    def folder(piece: str) -> Path:
        try:
            return suite(piece)
        except PieceFailed as err:
            pytest.fail(str(err), pytrace=False)

    return folder
