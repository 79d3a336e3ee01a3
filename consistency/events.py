"""What a model watch reports: a new latest version, or a holder added, changed or removed.

Plain data, free of the etcd client: the hub turns etcd's raw events into these
(`consistency.watch.ModelEvents`) and sends them as `WatchEvent` messages; the SDK reads
them back (`ros.client.watch`) without loading anything of etcd's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from consistency.records import HolderRecord

__all__ = ["EventKind", "WatchEvent"]


class EventKind(StrEnum):
    VERSION_PUBLISHED = "version_published"
    HOLDER_UPDATED = "holder_updated"
    HOLDER_REMOVED = "holder_removed"
    RESYNC = "resync"


@dataclass(frozen=True)
class WatchEvent:
    """A change to a model: a new latest version, or a holder added/changed/removed.

    A RESYNC event (after compaction) carries the model's latest version and every live
    holder per version in `holders`; events after it continue from its revision.
    """

    kind: EventKind
    version: int
    revision: int
    holder: HolderRecord | None = None
    holder_name: str = ""
    holders: dict[int, list[HolderRecord]] = field(default_factory=dict)
