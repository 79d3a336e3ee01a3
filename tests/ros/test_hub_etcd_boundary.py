"""The hub's handlers and caches make no etcd request and decode no record themselves: every
request and every decoding is in `consistency`'s registries (docs/design-notes.md, "What
each handler group receives")."""

from __future__ import annotations

import ast
from pathlib import Path

HUB = Path(__file__).resolve().parents[2] / "ros" / "hub"
# etcd client calls (consistency.etcd.Etcd) and request builders (consistency.ops)
REQUESTS = {
    "range", "range_keys", "txn", "count", "lease_grant", "lease_revoke", "lease_ttl",
    "compact",
}  # fmt: skip
OPS = {"put", "get", "delete", "absent", "exists"}
DECODING = {"parse_version_key", "parse_version_keys", "decode"}


def _names_etcd(owner: ast.expr) -> bool:
    name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
    return str(name).lstrip("_").endswith("etcd")


def _raw_etcd(source: str) -> list[str]:
    """Each raw etcd request, request builder or record decoding in `source`, by line."""
    found: list[tuple[int, int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name, owner = node.func.attr, node.func.value
        if name in REQUESTS or name in DECODING:
            if name == "decode" and not (isinstance(owner, ast.Name) and owner.id[0].isupper()):
                continue  # bytes.decode(); a record class's decode is `Record.decode(...)`
            found.append((node.lineno, node.col_offset, f"{node.lineno}: .{name}("))
        elif name in OPS and isinstance(owner, ast.Name) and owner.id == "ops":
            found.append((node.lineno, node.col_offset, f"{node.lineno}: ops.{name}("))
        elif name in OPS and _names_etcd(owner):  # `etcd.get(`, `self.etcd.put(`: dicts aside
            found.append((node.lineno, node.col_offset, f"{node.lineno}: etcd.{name}("))
    return [text for _, _, text in sorted(found)]


def test_no_module_of_ros_hub_makes_an_etcd_request_or_decodes_a_record() -> None:
    found = {
        path.name: raw for path in sorted(HUB.glob("*.py")) if (raw := _raw_etcd(path.read_text()))
    }
    assert found == {}


def test_the_check_sees_requests_builders_and_decoding() -> None:
    source = (
        "def f(etcd, keys, kv):\n"
        "    etcd.range('a', prefix=True)\n"
        "    etcd.txn([ops.absent('k')], [])\n"
        "    HolderRecord.decode(kv.value)\n"
        "    keys.parse_version_key('t', 'm', 'k')\n"
        "    kv.key.decode()\n"
        "    cache.get('k')\n"
        "    self.etcd.get('k')\n"
    )
    assert _raw_etcd(source) == [
        "2: .range(",
        "3: .txn(",
        "3: ops.absent(",
        "4: .decode(",
        "5: .parse_version_key(",
        "8: etcd.get(",
    ]
