"""Everything that talks to etcd: key schema, sessions, registries, watches, the revision floor.

Depends only on etcd (through python3-etcd3's generated stubs) and the shared `tensorhub`
error tree; never on `transport` or `ros`.
"""

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
