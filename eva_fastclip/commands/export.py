"""``eva-fastclip export``: an fp32 open_clip state dict or model folder from a checkpoint."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HELP = "write an fp32 open_clip state dict or model folder from a checkpoint"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="a complete checkpoint folder, e.g. .../step_00000500")
    p.add_argument(
        "--output",
        required=True,
        help="a .pt/.pth file: the state dict; any other path: open_clip's own folder "
        "(open_clip_config.json, open_clip_model.safetensors) that open_clip loads as local-dir:PATH "
        "without eva_fastclip",
    )


def run(args) -> int:
    from eva_fastclip.export import export_open_clip

    print(json.dumps(export_open_clip(Path(args.checkpoint), Path(args.output)), indent=2))
    return 0
