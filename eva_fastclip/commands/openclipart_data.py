"""``eva-fastclip openclipart-data``: Debian's openclipart-png drawings as train/val/zero-shot shards."""

from __future__ import annotations

import argparse
import json

HELP = "convert Debian's openclipart-png drawings into train/val/zero-shot shards"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", default="data/openclipart")
    p.add_argument("--root", default="/usr/share/openclipart/png", help="where openclipart-png put its PNGs")
    p.add_argument("--image-size", type=int, default=32)


def run(args) -> int:
    from eva_fastclip.data.openclipart import write_openclipart_dataset

    summary = write_openclipart_dataset(args.output, root=args.root, image_size=args.image_size)
    print(json.dumps({"output": args.output, **summary}, indent=2))
    return 0
