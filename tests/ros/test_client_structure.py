"""The SDK's helpers take narrow handles: none imports the client it serves (`ros.client.hub`,
or the `ros.client.base` it was once built on), and none calls a private member of the client
or of another helper's object (the grep of issue 24, which counted 25 such references)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

CLIENT = Path(__file__).resolve().parents[2] / "ros" / "client"
# the composition root and the package marker: the only modules that may build everything
NOT_HELPERS = {"hub.py", "base.py", "__init__.py"}
PRIVATE_REACH = re.compile(r"(self\._client|client|self\._c|hub|self\._hub)\._[a-z][a-z_]*")


def _helpers() -> list[Path]:
    helpers = sorted(p for p in CLIENT.glob("*.py") if p.name not in NOT_HELPERS)
    assert len(helpers) > 10  # the glob found the package
    return helpers


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_no_helper_imports_the_client() -> None:
    for path in _helpers():
        imported = _imports(path)
        assert "ros.client.base" not in imported, path.name
        assert "ros.client.hub" not in imported, path.name
    assert not (CLIENT / "base.py").exists()


def test_no_helper_reaches_into_a_private_member() -> None:
    reaches = [
        f"{path.name}:{number}: {match.group(0)}"
        for path in _helpers()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for match in PRIVATE_REACH.finditer(line)
    ]
    assert reaches == []
