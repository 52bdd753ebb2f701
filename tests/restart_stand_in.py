"""A stand-in for the ``deepspeed`` command under the restart supervisor
(eva_fastclip/reliability/supervisor.py): a script that records its arguments and exits with the codes it is
given, one per run (tests/test_restarts.py, tests/launched/test_restarts_sigterm.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def stand_in(tmp_path: Path, codes: list[int], sleep: float = 0.0) -> list[str]:
    """A command that appends its arguments to calls.jsonl and exits with the next of ``codes``."""
    script = tmp_path / "stand_in.py"
    script.write_text(
        "import json, sys, time\n"
        f"calls = {str(tmp_path / 'calls.jsonl')!r}\n"
        "with open(calls, 'a') as f: f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"codes = {codes!r}\n"
        "n = sum(1 for _ in open(calls))\n"
        f"time.sleep({sleep})\n"
        "sys.exit(codes[min(n, len(codes)) - 1])\n"
    )
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"train": {"output_dir": str(tmp_path / "run")}}))
    return [sys.executable, str(script), "--module", "eva_fastclip", "train", "--config", str(config)]


def calls(tmp_path: Path) -> list[list[str]]:
    """The stand-in's arguments, one list per run."""
    return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
