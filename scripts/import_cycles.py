"""The import graph of the product packages, and the circles in it.

Builds, with `ast`, which module of ros, transport, consistency, tensorhub, bench and chaos
imports which, and prints the strongly connected components of more than one module (files
that import each other in a loop). Three graphs are counted apart:

- module level: the imports that run when the module is first imported;
- module and function level: those plus the imports inside functions (run on first call);
- with the imports under `if TYPE_CHECKING:` too (they never run; the issue's count).

An edge goes to the module named (`from a.b import c` goes to `a.b.c` when that is a
module, else to `a.b`); the packages above it are not counted as imported, so a package
`__init__` that re-exports its modules makes no circle by itself.

`python scripts/import_cycles.py` prints the counts and each circle; `--exclude A,B` shows
circles made only of the named modules apart. `reachable` follows the same graph from the
product's entry points. tests/test_import_cycles.py keeps the count at 0, and
tests/test_wheel_contents.py checks that the wheel ships only what its entry points reach.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ros", "transport", "consistency", "tensorhub", "bench", "chaos")
GENERATED = ("_pb2.py", "_pb2_grpc.py")


@dataclass
class Module:
    """One module of the product: its file, and the modules it imports, by where."""

    name: str
    path: Path
    is_package: bool
    top: set[str] = field(default_factory=set)
    inner: set[str] = field(default_factory=set)
    typing: set[str] = field(default_factory=set)
    strings: set[str] = field(default_factory=set)


def module_files(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Every product module by its dotted name (generated protobuf code left out)."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if path.name.endswith(GENERATED):
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


TOP, INNER, TYPING = "top", "inner", "typing"


def _imports(node: ast.AST, where: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Each import statement below `node`, with where it sits: TOP, INNER or TYPING."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.body:
                yield from _imports(ast.Module([other], []), TYPING)
            for other in child.orelse:
                yield from _imports(ast.Module([other], []), where)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, where
            continue
        function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _imports(child, INNER if function and where == TOP else where)


def _targets(
    statement: ast.Import | ast.ImportFrom, module: Module, known: dict[str, Path]
) -> Iterator[str]:
    if isinstance(statement, ast.Import):
        for alias in statement.names:
            yield alias.name
        return
    base = statement.module or ""
    if statement.level:
        here = module.name.split(".")
        if not module.is_package:
            here.pop()
        here = here[: len(here) - (statement.level - 1)]
        base = ".".join([*here, base] if base else here)
    for alias in statement.names:
        candidate = f"{base}.{alias.name}"
        yield candidate if candidate in known else base


def _string_constants(tree: ast.AST) -> set[str]:
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def module_graph(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Module]:
    """Every product module with the product modules it imports (others left out)."""
    known = module_files(root, packages)
    modules: dict[str, Module] = {}
    for name, path in known.items():
        module = Module(name, path, path.name == "__init__.py")
        tree = ast.parse(path.read_text(), str(path))
        for statement, where in _imports(tree, TOP):
            for target in _targets(statement, module, known):
                if target in known and target != name:
                    getattr(module, where).add(target)
        module.strings = {s for s in _string_constants(tree) if s in known and s != name}
        modules[name] = module
    return modules


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one node, each sorted, iteratively (no recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def cycles(modules: dict[str, Module], *kinds: str) -> list[list[str]]:
    """The circles of the graph of the imports of the given kinds (TOP, INNER, TYPING)."""
    edges = {name: set().union(*(getattr(m, k) for k in kinds)) for name, m in modules.items()}
    return strongly_connected(edges)


def reachable(modules: dict[str, Module], roots: Iterable[str]) -> set[str]:
    """The modules that running `roots` can load: what they import, at module or function
    level, the packages above each, and the modules they name in a string (a dispatch
    table such as the CLI's, `python -m NAME` in a child process's command line)."""
    seen: set[str] = set()
    todo = [r for r in roots if r in modules]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        module = modules[name]
        todo.extend(module.top | module.inner | module.strings)
    return seen & set(modules)


def split(found: list[list[str]], excluded: set[str]) -> tuple[list[list[str]], list[list[str]]]:
    """(circles with a module outside `excluded`, circles made only of excluded modules)."""
    kept = [c for c in found if not set(c) <= excluded]
    apart = [c for c in found if set(c) <= excluded]
    return kept, apart


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--exclude", default="", help="comma-separated modules whose own circles are shown apart"
    )
    parser.add_argument("--root", type=Path, default=ROOT, help="the tree to read (a checkout)")
    args = parser.parse_args(argv)
    excluded = {m for m in args.exclude.split(",") if m}
    modules = module_graph(args.root)
    print(f"{len(modules)} modules")
    graphs = (
        ("module level", (TOP,)),
        ("module and function level", (TOP, INNER)),
        ("with TYPE_CHECKING imports too", (TOP, INNER, TYPING)),
    )
    for label, kinds in graphs:
        kept, apart = split(cycles(modules, *kinds), excluded)
        print(f"{label}: {len(kept)} circles" + (f" (+{len(apart)} excluded)" if apart else ""))
        for component in kept:
            print("  " + " <-> ".join(component))
        for component in apart:
            print("  excluded: " + " <-> ".join(component))
    return 0


if __name__ == "__main__":
    sys.exit(main())
