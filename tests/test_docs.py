"""The documentation names every config key that the code has, and the commands it shows exist."""

import dataclasses
import importlib
import re
import shlex
from pathlib import Path

import pytest

from eva_fastclip.cli import build_parser
from eva_fastclip.config import ExperimentConfig

DOCS = Path(__file__).parents[1] / "docs"


def config_keys():
    for section in dataclasses.fields(ExperimentConfig):
        for f in dataclasses.fields(section.default_factory()):
            yield f"{section.name}.{f.name}"


def test_every_config_key_is_documented():
    reference = (DOCS / "configuration.md").read_text()
    missing = [key for key in config_keys() if f"`{key}`" not in reference]
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_documented_keys_exist():
    reference = (DOCS / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `((?:model|data|loss|optim|train|eval)\.\w+)`", reference, re.M))
    assert documented == set(config_keys())


def test_readme_subcommands_exist():
    readme = (DOCS.parent / "README.md").read_text()
    used = set(re.findall(r"eva-fastclip ([a-z-]+)", readme))
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    assert used <= set(subparsers.choices), used - set(subparsers.choices)


#: ``python -m benchmarks.name OPTIONS`` (not the placeholder NAME) up to the end of its line, an inline
#: code span or a comment
BENCHMARK_COMMAND = re.compile(r"python3? -m (benchmarks\.[a-z_]+)\b([^`#\n]*)")


def benchmark_commands(markdown: str) -> list[tuple[str, str]]:
    """(module, options) of every benchmark command in ``markdown``: in code blocks a line (continued by a
    backslash), in the text an inline code span, which may wrap onto the next line."""
    parts = markdown.replace("\\\n", " ").split("```")
    for i in range(0, len(parts), 2):  # the text between the code blocks
        parts[i] = re.sub(r"`[^`]+`", lambda span: span.group(0).replace("\n", " "), parts[i])
    return BENCHMARK_COMMAND.findall("```".join(parts))


def test_documented_benchmark_commands_parse():
    """Every benchmark command of the README and docs/ names a benchmark and options it has; none is an
    ``eva-fastclip`` subcommand any more (benchmarks sit outside the package)."""
    for path in [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = path.read_text()
        assert "eva-fastclip bench-" not in text, path
        for module, options in benchmark_commands(text):
            parser = importlib.import_module(module).build_parser()
            try:
                parser.parse_args(shlex.split(options))
            except SystemExit:
                pytest.fail(f"{path.name}: python -m {module}{options}")
