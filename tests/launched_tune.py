"""The user's three commands of tests/launched/test_tune_two_ranks.py in one launch (``deepspeed --num_gpus 2
tests/launched_tune.py OUT CONFIG_ARGS...``, or the rank pool's ranks), each through
``eva_fastclip.cli.main`` as the launcher would run it, so the ranks' start-up is paid once:

1. ``tune`` without a limit: OUT/first.json (its trials measure the two largest micro-batches);
2. ``tune --memory-limit-gib L --memory-margin 0 --no-data`` with L halfway between those two measured
   peaks: OUT/second.json;
3. ``train --config OUT/second.json`` for 2 steps, loading in the training process (``data.workers=0``:
   the layout and DeepSpeed JSON that tune chose are what it trains; its loader workers are the first
   search's to measure).

Each command's exit code goes to OUT/codes_rank_K.json; rank 0 writes OUT/limit.txt.
"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from eva_fastclip.cli import main

RANK = int(os.environ.get("RANK", "0"))


def two_largest_peaks(trials: Path) -> tuple[float, float]:
    rows = json.loads(trials.read_text())["trials"]
    measured = sorted(
        (
            r
            for r in rows
            if r["peak_gib"] is not None and r["zero_stage"] == 0 and not r["grad_checkpointing"]
        ),
        key=lambda r: -r["micro_batch"],
    )
    return measured[0]["peak_gib"], measured[1]["peak_gib"]


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher's own argument
    out, config_args = Path(args[0]), args[1:]
    quick = ["--probe-steps", "1"]  # the peaks are the same; the speeds, noisier, are not under test
    codes = [main(["tune", *config_args, *quick, "--output", str(out / "first.json")])]
    dist.barrier()  # rank 0 wrote the trials
    largest, next_one = two_largest_peaks(out / "first.trials.json")
    limit = (largest + next_one) / 2
    if RANK == 0:
        (out / "limit.txt").write_text(f"{limit!r}\n")
    second = ["--output", str(out / "second.json"), "--memory-limit-gib", repr(limit), "--memory-margin", "0"]
    codes.append(main(["tune", *config_args, *quick, *second, "--no-data"]))
    dist.barrier()
    sets = [f"train.output_dir={out / 'trained'}", "train.steps=2", "data.workers=0"]
    sets += ["eval.zeroshot_dir=null", "eval.retrieval_shards=null"]
    trained = [arg for value in sets for arg in ("--set", value)]
    codes.append(main(["train", "--config", str(out / "second.json"), *trained]))
    (out / f"codes_rank_{RANK}.json").write_text(json.dumps(codes))
