"""No circle of imports among the product modules (scripts/import_cycles.py).

The count takes every import that runs (module level and inside functions) and those under
`if TYPE_CHECKING:` too. One circle is counted apart while its modules are restructured:
ros.client.delta_bases, delta_fetch and handles (issue 37, item 1).
"""

from __future__ import annotations

from pathlib import Path

from tests.script_modules import load

APART = {"ros.client.delta_bases", "ros.client.delta_fetch", "ros.client.handles"}


def test_no_import_circle_among_product_modules() -> None:
    script = load()
    modules = script.module_graph()
    assert "ros.hub.server" in modules
    assert "chaos.worker" in modules
    found = script.cycles(modules, script.TOP, script.INNER, script.TYPING)
    kept, _apart = script.split(found, APART)
    assert kept == []


def test_the_script_sees_a_circle_through_a_function_level_import(tmp_path: Path) -> None:
    """Self-check: a circle closed only inside a function, or only for the type checker,
    is found, and named by its modules."""
    script = load()
    package = tmp_path / "ros"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from ros.b import thing\n")
    (package / "b.py").write_text("def thing():\n    from ros import a\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ros.d import x\n"
    )
    (package / "d.py").write_text("from . import c\n")
    modules = script.module_graph(tmp_path, ("ros",))
    assert script.cycles(modules, script.TOP) == []
    assert script.cycles(modules, script.TOP, script.INNER) == [["ros.a", "ros.b"]]
    assert script.cycles(modules, script.TOP, script.INNER, script.TYPING) == [
        ["ros.a", "ros.b"],
        ["ros.c", "ros.d"],
    ]
