"""What every benchmark's ``main`` shares: its log on the console, errors told as argparse tells its own."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable


def run_main(parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], int], argv) -> int:
    """``run(parser.parse_args(argv))``; a wrong value it finds (ValueError, ConfigError among them) or a
    missing file prints as ``PROG: error: ...`` and gives exit status 2, as a bad option does."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except (FileNotFoundError, ValueError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
