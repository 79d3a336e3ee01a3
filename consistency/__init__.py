"""Everything that talks to etcd: key schema, sessions, registries, watches, the revision floor.

Depends only on etcd (through python3-etcd3's generated stubs) and the shared `tensorhub`
error tree; never on `transport` or `ros`.

The names below are imported when first used (PEP 562), not with the package: the SDK
imports a few of its modules (`retry`, `reopen`, `stream`, `floor`, `records`, `events`),
none of which needs the etcd client or the embedded etcd launcher, and a package that
loaded every registry would make every `import ros` load both
(tests/ros/test_sdk_imports.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from consistency.compactor import Compactor, CompactorStatus
    from consistency.embedded import EtcdCluster
    from consistency.etcd import Etcd
    from consistency.events import EventKind, WatchEvent
    from consistency.floor import RevisionFloor
    from consistency.holders import HolderRegistry
    from consistency.keys import DEFAULT_PREFIX, Keys
    from consistency.manifests import ManifestHeader
    from consistency.publishing import Published
    from consistency.records import HolderRecord, HolderState, ShardRecord
    from consistency.session import Session
    from consistency.versions import VersionInfo, VersionRegistry
    from consistency.watch import KeyWatch

_HOMES = {
    "Compactor": "consistency.compactor",
    "CompactorStatus": "consistency.compactor",
    "DEFAULT_PREFIX": "consistency.keys",
    "Etcd": "consistency.etcd",
    "EtcdCluster": "consistency.embedded",
    "EventKind": "consistency.events",
    "HolderRecord": "consistency.records",
    "HolderRegistry": "consistency.holders",
    "HolderState": "consistency.records",
    "KeyWatch": "consistency.watch",
    "Keys": "consistency.keys",
    "ManifestHeader": "consistency.manifests",
    "Published": "consistency.publishing",
    "RevisionFloor": "consistency.floor",
    "Session": "consistency.session",
    "ShardRecord": "consistency.records",
    "VersionInfo": "consistency.versions",
    "VersionRegistry": "consistency.versions",
    "WatchEvent": "consistency.events",
}


def __getattr__(name: str) -> Any:
    """`consistency.X`: imported from its module on first use (module docstring)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'consistency' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


__all__ = [
    "DEFAULT_PREFIX",
    "Compactor",
    "CompactorStatus",
    "Etcd",
    "EtcdCluster",
    "EventKind",
    "HolderRecord",
    "HolderRegistry",
    "HolderState",
    "KeyWatch",
    "Keys",
    "ManifestHeader",
    "Published",
    "RevisionFloor",
    "Session",
    "ShardRecord",
    "VersionInfo",
    "VersionRegistry",
    "WatchEvent",
]
