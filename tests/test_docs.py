"""The documentation names every config key that the code has, and the README's commands exist."""

import dataclasses
import re
from pathlib import Path

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
