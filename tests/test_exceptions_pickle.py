"""Every exception eva_fastclip defines survives pickle: rank 0's verdict reaches the other ranks pickled
(reliability/process.py's ``on_rank0``), loader workers send theirs to the main process the same way. An
exception whose ``__init__`` takes other arguments than its message comes back garbled or not at all
(PreflightError came back as one "problem" per character of its message)."""

import ast
import builtins
import importlib
import pickle
from pathlib import Path

import pytest

from eva_fastclip.plan.preflight import PreflightError, Problem

PACKAGE = Path(__file__).parents[1] / "eva_fastclip"
BUILTIN_EXCEPTIONS = {
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
}

#: an instance of each, made as the code raises it
EXAMPLES = {
    "ConfigError": lambda cls: cls("train.steps must be positive"),
    "PreflightError": lambda cls: cls(
        [Problem("data.num_samples", "s3:// shards record no size: set data.num_samples"), Problem("a", "b")]
    ),
    "BadSample": lambda cls: cls("decode", "shard-000001.tar", "sample 7: cannot identify image file"),
    "CommandFailed": lambda cls: cls("curl -s -f http://host/shard-000001.tar", 18),
}


def defined_exceptions() -> list[tuple[str, str]]:
    """(module, class) of every exception class in the package, found in its source: a class whose base is
    a built-in exception or another one found."""
    classes = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                classes[node.name] = (module, bases)
    found: dict[str, str] = {}
    grew = True
    while grew:
        grew = False
        for name, (module, bases) in classes.items():
            if name not in found and any(b in BUILTIN_EXCEPTIONS or b in found for b in bases):
                found[name], grew = module, True
    return sorted((module, name) for name, module in found.items())


def test_every_exception_the_package_defines_is_found():
    names = {name for _, name in defined_exceptions()}
    assert {"ConfigError", "PreflightError", "BadSample", "NonFiniteSteps", "Preempted"} <= names


@pytest.mark.parametrize(("module", "name"), defined_exceptions())
def test_exception_round_trips_through_pickle(module, name):
    cls = getattr(importlib.import_module(module), name)
    error = EXAMPLES.get(name, lambda cls: cls(f"{name}: what went wrong, and the fix"))(cls)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls
    assert str(back) == str(error)
    assert vars(back) == vars(error)  # the attributes a handler reads (errors, reason, url, ...)


def test_a_preflight_error_keeps_its_readable_list_through_pickle():
    error = EXAMPLES["PreflightError"](PreflightError)
    back = pickle.loads(pickle.dumps(error))
    assert back.errors == error.errors
    assert str(back).splitlines() == [
        "2 problem(s) before step 1:",
        "  - data.num_samples: s3:// shards record no size: set data.num_samples",
        "  - a: b",
    ]
