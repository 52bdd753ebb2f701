"""``eva-fastclip toy-data``: the embedded default dataset (procedurally drawn scenes)."""

from __future__ import annotations

import argparse
import json

HELP = "write the embedded default dataset (procedurally drawn scenes)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", default="data/toy")
    p.add_argument("--num-train", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    from eva_fastclip.data import write_toy_dataset

    summary = write_toy_dataset(args.output, num_train=args.num_train, seed=args.seed)
    print(json.dumps(summary, indent=2, default=str))
    return 0
