"""What several commands share: the experiment config's arguments, and logging."""

from __future__ import annotations

import argparse
import logging
import os


def add_config_args(p: argparse.ArgumentParser) -> None:
    """``--config FILE`` and repeatable ``--set KEY=VALUE`` (read by ``eva_fastclip.config.load_config``)."""
    p.add_argument("--config", default=None, help="experiment config JSON (see configs/)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.batch_size=32 (repeatable)",
    )


def setup_logging() -> None:
    """INFO on rank 0, warnings only on the other ranks (one rank's log speaks for the run)."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
