"""``eva-fastclip make-shards``: a folder of images and a CSV/JSONL of captions into training shards."""

from __future__ import annotations

import argparse
import json

HELP = "turn a folder of images and a CSV/TSV/JSONL of captions into shards"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", required=True, help="folder the captions file's image paths are relative to")
    p.add_argument("--captions", required=True, help="CSV or TSV (with header), or JSONL file")
    p.add_argument("--output", required=True, help="output folder for shard-*.tar and manifest.json")
    p.add_argument("--samples-per-shard", type=int, default=10000)
    p.add_argument("--start-index", type=int, default=0, help="dataset index of the first row")
    # open_clip_train's names (--csv-*); --image-column/--caption-column are this command's older names
    p.add_argument(
        "--csv-img-key",
        "--image-column",
        dest="image_column",
        default=None,
        metavar="COLUMN",
        help="column of the image paths (default: 'image' or OpenCLIP's 'filepath', found in the header)",
    )
    p.add_argument(
        "--csv-caption-key",
        "--caption-column",
        dest="caption_column",
        default=None,
        metavar="COLUMN",
        help="column of the captions (default: 'caption' or OpenCLIP's 'title', found in the header)",
    )
    p.add_argument(
        "--csv-separator",
        default=None,
        metavar="SEP",
        help=r"one character; '\t' is a tab (default: tab if the header has one, else comma)",
    )


def run(args) -> int:
    from eva_fastclip.data import write_shards

    manifest = write_shards(
        args.images,
        args.captions,
        args.output,
        samples_per_shard=args.samples_per_shard,
        start_index=args.start_index,
        image_column=args.image_column,
        caption_column=args.caption_column,
        separator=args.csv_separator,
    )
    summary = {k: manifest[k] for k in ("num_samples", "index_min", "index_max", "skipped")}
    print(json.dumps({"output": args.output, **summary}, indent=2))
    return 0
