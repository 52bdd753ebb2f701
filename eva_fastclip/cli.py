"""Command line: ``eva-fastclip <command>`` or ``python -m eva_fastclip <command>``.

Under the DeepSpeed launcher: ``deepspeed --num_gpus N --module eva_fastclip train --config FILE``.
Each command is a module of ``eva_fastclip/commands/`` (its arguments, its run); this one assembles them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from eva_fastclip.commands import COMMANDS
from eva_fastclip.commands.common import setup_logging
from eva_fastclip.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging()
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"eva-fastclip {args.command}: error: {err}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eva-fastclip", description=__doc__.splitlines()[0])
    # the deepspeed launcher passes --local_rank=N before the command; LOCAL_RANK carries the same value
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        command = importlib.import_module(module)  # light: a command imports what it runs in its run()
        p = sub.add_parser(name, help=command.HELP)
        command.add_arguments(p)
        p.set_defaults(func=command.run)
    return parser
