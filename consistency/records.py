"""Small records stored as etcd values: holder records, shard records, seed claims.

JSON, so an operator can read them with `etcdctl get`. Manifests are opaque bytes to this
package (the SDK owns their protobuf format); everything here is metadata about holders.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

from tensorhub.errors import InvalidArgument
from tensorhub.names import validate_name


class HolderState(StrEnum):
    """PARTIAL: serving the chunks it has while still receiving. COMPLETE: has every byte."""

    PARTIAL = "PARTIAL"
    COMPLETE = "COMPLETE"


@dataclass(frozen=True)
class HolderRecord:
    """Who holds a version, where to read it, and under which session (lease).

    `revision` is the etcd create_revision of the record: the holder's fencing token. It is
    filled in when a record is read back (it cannot be known before the write). `shard` is
    the index of the one shard a holder of a model-parallel version holds (None: the whole
    version); readers of shard i read only from holders of shard i.
    """

    holder: str
    endpoints: dict[str, str]
    topology: dict[str, str] = field(default_factory=dict)
    state: HolderState = HolderState.PARTIAL
    session: int = 0
    revision: int = 0
    shard: int | None = None

    def __post_init__(self) -> None:
        validate_name(self.holder, "holder")
        if self.shard is not None and (not isinstance(self.shard, int) or self.shard < 0):
            raise InvalidArgument(f"invalid shard index {self.shard!r}: must be an integer >= 0")
        if not isinstance(self.state, HolderState):
            object.__setattr__(self, "state", HolderState(self.state))

    @property
    def complete(self) -> bool:
        return self.state is HolderState.COMPLETE

    def with_state(self, state: HolderState) -> HolderRecord:
        return replace(self, state=state)

    def encode(self) -> bytes:
        data = asdict(self)
        data["state"] = self.state.value
        del data["revision"]  # derived from the key's create_revision on read
        if self.shard is None:
            del data["shard"]  # whole-version records stay as they always were
        return json.dumps(data, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes, revision: int = 0) -> HolderRecord:
        data = _load(raw, "holder record")
        try:
            return cls(
                holder=str(data["holder"]),
                endpoints={str(k): str(v) for k, v in dict(data["endpoints"]).items()},
                topology={str(k): str(v) for k, v in dict(data.get("topology", {})).items()},
                state=HolderState(data["state"]),
                session=int(data["session"]),
                revision=revision,
                shard=None if data.get("shard") is None else int(data["shard"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"malformed holder record: {exc}") from exc


@dataclass(frozen=True)
class ShardRecord:
    """One model-parallel rank's part of a version: its manifest part and who wrote it."""

    index: int
    count: int
    holder: str
    manifest: bytes

    def encode(self) -> bytes:
        return json.dumps(
            {
                "index": self.index,
                "count": self.count,
                "holder": self.holder,
                "manifest": self.manifest.hex(),
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> ShardRecord:
        data = _load(raw, "shard record")
        try:
            return cls(
                index=int(data["index"]),
                count=int(data["count"]),
                holder=str(data["holder"]),
                manifest=bytes.fromhex(str(data["manifest"])),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"malformed shard record: {exc}") from exc


def sharded_marker(count: int) -> bytes:
    """The `manifest` value of a model-parallel version: its parts are the shard records."""
    return json.dumps({"sharded": count}).encode()


def sharded_count(manifest: bytes) -> int:
    """The shard count if `manifest` is a sharded marker, else 0."""
    if not manifest.startswith(b'{"sharded"'):
        return 0
    try:
        return int(json.loads(manifest)["sharded"])
    except (ValueError, KeyError, TypeError):
        return 0


def _load(raw: bytes, what: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise InvalidArgument(f"malformed {what}: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidArgument(f"malformed {what}: not an object")
    return data
