"""The house's limits, measured on the code itself (docs/development.md): no module in the package or the
benchmarks over 600 lines, no function over 80, no class over 450, no import cycle in the package, and the
package never imports the benchmarks. A limit that blocks a natural design is raised here, with the
reason beside it, not worked around."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
ROOTS = ("eva_fastclip", "benchmarks")
MAX_MODULE, MAX_FUNCTION, MAX_CLASS = 600, 80, 450


def modules(root: str) -> dict[str, Path]:
    """Dotted name -> file, for every module under ``root``."""
    found = {}
    for path in sorted((REPO / root).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def over_the_limits(path: Path) -> list[str]:
    source = path.read_text()
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    found = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE:
        found.append(f"{shown}: {lines} lines (module limit {MAX_MODULE})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            length = node.end_lineno - node.lineno + 1
            limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
            if length > limit:
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                found.append(f"{shown}:{node.lineno} {kind} {node.name}: {length} lines")
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports, anywhere in it (a function's lazy import
    included). ``from package import submodule`` counts as importing the submodule."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known.keys()
            found |= submodules or {base}
    return {module for module in found if module in known and module != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("root", ROOTS)
def test_no_module_function_or_class_over_its_limit(root):
    found = [problem for path in modules(root).values() for problem in over_the_limits(path)]
    assert found == [], "\n".join(found)


def test_the_limits_are_measured(tmp_path):
    """The measure itself: a module written over each limit is found."""
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION))
    source = f"class Big:\n    def long(self):\n{body}\n" + "\n" * MAX_CLASS + "    y = 0\n"
    path = tmp_path / "probe.py"
    path.write_text(source + "pass\n" * MAX_MODULE)
    kinds = " ".join(over_the_limits(path))
    assert "lines (module limit" in kinds and "function long" in kinds and "class Big" in kinds


def test_no_import_cycle_and_the_package_never_imports_the_benchmarks():
    package, benchmarks = modules("eva_fastclip"), modules("benchmarks")
    known = {**package, **benchmarks}
    graph = {name: imports_of(name, path, known) for name, path in package.items()}
    assert cycles(graph) == []
    upward = {
        name: sorted(deps & benchmarks.keys()) for name, deps in graph.items() if deps & benchmarks.keys()
    }
    assert upward == {}
    # the measure itself: a cycle of two modules is one
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
