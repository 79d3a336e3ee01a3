"""The wheel ships what users run: every module of the packages pyproject.toml installs is
reached from a product entry point, so no lab or test-only code is shipped as product.

The entry points: the console scripts and plugin entry points of pyproject.toml, and what
users import (the SDK, `import ros`; the error tree, `import tensorhub`; the engine
integrations, `ros.integrations.*`; `python -m` of a package's `__main__`). A module
reaches another by importing it, at module level or inside a function, or by naming it in a
string: the CLI's command table (`tensorhub bench`, `tensorhub chaos run`) and the child
processes started as `python -m NAME` (scripts/import_cycles.py, `reachable`).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from tests.script_modules import ROOT, load

USER_IMPORTS = ("ros", "tensorhub")
# packages whose every module is an API users import (docs/integrations.md, docs/views.md:
# `ros.views.sharded.quantize_shard` for a trainer's own ranks)
USER_PACKAGES = ("ros.integrations", "ros.views")


def _installed_packages(pyproject: dict[str, object]) -> list[str]:
    tool = pyproject["tool"]
    assert isinstance(tool, dict)
    include = tool["setuptools"]["packages"]["find"]["include"]
    return [pattern.rstrip("*") for pattern in include]


def _entry_points(pyproject: dict[str, object]) -> set[str]:
    project = pyproject["project"]
    assert isinstance(project, dict)
    targets = list(project.get("scripts", {}).values())
    for group in project.get("entry-points", {}).values():
        targets.extend(group.values())
    return {target.split(":")[0] for target in targets}


def _roots(modules: dict[str, object], pyproject: dict[str, object]) -> set[str]:
    roots = _entry_points(pyproject) | set(USER_IMPORTS)
    for name in modules:
        if name.endswith(".__main__") or name.startswith(tuple(f"{p}." for p in USER_PACKAGES)):
            roots.add(name)
    return roots


def _unreachable(root: Path) -> tuple[set[str], set[str]]:
    """(the shipped modules no entry point reaches, every shipped module) of a checkout."""
    script = load()
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    modules = script.module_graph(root, _installed_packages(pyproject))
    reached = script.reachable(modules, _roots(modules, pyproject))
    return set(modules) - reached, set(modules)


def test_every_shipped_module_is_reached_from_a_product_entry_point() -> None:
    unreachable, shipped = _unreachable(ROOT)
    assert {"ros.cli", "bench.cli", "chaos.roles", "ros.hub.server"} <= shipped
    assert sorted(unreachable) == []


def test_the_check_sees_a_module_only_tests_reach(tmp_path: Path) -> None:
    """Self-check: in a small checkout, a module nothing but a test imports is named, while
    one reached through the command table, one a child process runs with `python -m`, and
    one imported inside a function are not."""
    (tmp_path / "pyproject.toml").write_text(
        '[project.scripts]\ntool = "app.cli:main"\n'
        '[tool.setuptools.packages.find]\ninclude = ["app*"]\n'
    )
    app = tmp_path / "app"
    app.mkdir()
    files = {
        "__init__.py": "",
        "cli.py": 'COMMANDS = {"run": "app.run"}\n',
        "run.py": 'ARGV = ["python", "-m", "app.child"]\n',
        "child.py": "def main():\n    from app import inner\n",
        "inner.py": "",
        "lab.py": "from app import run\n",
    }
    for name, text in files.items():
        (app / name).write_text(text)
    unreachable, shipped = _unreachable(tmp_path)
    assert shipped == {"app", "app.cli", "app.run", "app.child", "app.inner", "app.lab"}
    assert unreachable == {"app.lab"}
