"""The commands of ``eva-fastclip``, one module each (``eva_fastclip/cli.py`` assembles them).

A command module has ``HELP`` (its line in ``eva-fastclip --help``), ``add_arguments(parser)`` and
``run(args) -> int`` (the exit status). It imports at its top only what its arguments need; what it runs
(torch, DeepSpeed, open_clip) it imports inside ``run``, so that building the parser stays fast.

The commands that measure or check the user's own setup live here (``loader-speed``, ``tune
--estimate-only``, ``train --dry-run``); comparisons against the references' code live in
``benchmarks/`` at the repository's top (``python -m benchmarks.speed`` ...), which the package never
imports.
"""

#: command name -> its module, in the order ``eva-fastclip --help`` lists them
COMMANDS: dict[str, str] = {
    "train": "eva_fastclip.commands.train",
    "tune": "eva_fastclip.commands.tune",
    "eval": "eva_fastclip.commands.eval",
    "export": "eva_fastclip.commands.export",
    "make-shards": "eva_fastclip.commands.make_shards",
    "toy-data": "eva_fastclip.commands.toy_data",
    "openclipart-data": "eva_fastclip.commands.openclipart_data",
    "loader-speed": "eva_fastclip.commands.loader_speed",
}
