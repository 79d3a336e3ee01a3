"""Small records stored as etcd values: holder records and shard records.

JSON, so an operator can read them with `etcdctl get`. Manifests are opaque bytes to this
package (the SDK owns their protobuf format); what is here is metadata about holders and
where a manifest's bytes are (`PartHeader`: one JSON line, then any inline manifest bytes).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
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
        """JSON with sorted keys: the same record always encodes to the same bytes (a
        COMPLETE update compares the stored PARTIAL record's value). Built field by field,
        not with `dataclasses.asdict`, whose deep copies were a tenth of the hub's CPU in
        `bench delta`; the bytes are the same (`tests/consistency/test_records.py`)."""
        data: dict[str, Any] = {
            "endpoints": dict(self.endpoints),
            "holder": self.holder,
            "session": self.session,
            "state": self.state.value,
            "topology": dict(self.topology),
        }  # no `revision`: derived from the key's create_revision on read
        if self.shard is not None:  # a whole-version record carries no shard field
            data["shard"] = self.shard
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


HEADER_FORMAT = 1  # the `format` of a manifest header; a reader refuses any other


@dataclass(frozen=True)
class PartHeader:
    """Where one manifest (a whole version's, or one shard's) is, and how to check it.

    `size` bytes with SHA-256 `digest`, stored either `inline` (small manifests: no pages),
    in `pages` pages written by publish attempt `writer` (`consistency.manifests`), or, a
    shard of a group publish, compressed in `pack` (the id of the pack its batch wrote) at
    `offset`, `stored` bytes long (`consistency.manifest_packs`).
    The header of a model-parallel version itself holds no manifest, only `shards`.
    `session`: the session that published this part (0: not recorded); the hub accepts a
    delta companion of a version only from the session that published its base
    (`ros.hub.companions`).
    """

    size: int
    digest: bytes
    pages: int = 0
    writer: str = ""
    inline: bytes = b""
    shards: int = 0
    session: int = 0
    pack: str = ""
    offset: int = 0
    stored: int = 0

    def fields(self) -> dict[str, Any]:
        """The JSON part of the encoding (the inline bytes follow it raw)."""
        data: dict[str, Any] = {
            "format": HEADER_FORMAT,
            "size": self.size,
            "sha256": self.digest.hex(),
            "pages": self.pages,
            "writer": self.writer,
            "shards": self.shards,
        }
        if self.session:  # absent when not recorded: such a header encodes as it always has
            data["session"] = self.session
        if self.pack:  # absent unless packed, as above
            data.update(pack=self.pack, offset=self.offset, stored=self.stored)
        return data

    def encode(self) -> bytes:
        """One JSON line, then the inline manifest bytes as they are (no hex, no base64)."""
        return _frame(self.fields(), self.inline)

    @classmethod
    def decode(cls, raw: bytes) -> PartHeader:
        """A header; or, of a version published before headers existed, the manifest itself
        (`{"sharded": n}` for a model-parallel one), read as an inline header."""
        if raw.startswith(b'{"sharded"'):
            return cls(0, b"", shards=int(_load(raw, "sharded marker").get("sharded", 0)))
        if not raw.startswith(b'{"format"'):  # a serialized Manifest never starts with '{'
            return cls(len(raw), hashlib.sha256(raw).digest(), inline=raw)
        return cls.from_fields(*_unframe(raw, "manifest header"))

    @classmethod
    def from_fields(cls, data: dict[str, Any], inline: bytes) -> PartHeader:
        try:
            if int(data["format"]) != HEADER_FORMAT:
                raise InvalidArgument(
                    f"malformed manifest header: unknown format {data['format']!r}"
                )
            header = cls(
                size=int(data["size"]),
                digest=bytes.fromhex(str(data["sha256"])),
                pages=int(data["pages"]),
                writer=str(data["writer"]),
                inline=inline,
                shards=int(data.get("shards", 0)),
                session=int(data.get("session", 0)),
                pack=str(data.get("pack", "")),
                offset=int(data.get("offset", 0)),
                stored=int(data.get("stored", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"malformed manifest header: {exc}") from exc
        if header.pages and inline:
            raise InvalidArgument("malformed manifest header: both pages and inline bytes")
        if header.pack and (header.pages or inline or header.offset < 0 or header.stored <= 0):
            raise InvalidArgument(
                "malformed manifest header: a pack with pages, inline bytes or no stored bytes"
            )
        return header


@dataclass(frozen=True)
class ShardRecord:
    """One model-parallel rank's part of a version: its manifest's header and who wrote it.

    `manifest` is not stored in the record: `VersionRegistry.describe` fills it with the
    part's bytes, read from the header's inline bytes or pages.
    """

    index: int
    count: int
    holder: str
    part: PartHeader
    manifest: bytes = field(default=b"", compare=False, repr=False)

    def encode(self) -> bytes:
        data = {"index": self.index, "count": self.count, "holder": self.holder}
        return _frame({**self.part.fields(), **data}, self.part.inline)

    @classmethod
    def decode(cls, raw: bytes) -> ShardRecord:
        legacy = b"\n" not in raw  # written before headers: its manifest part in hex
        data, inline = (
            (_load(raw, "shard record"), b"") if legacy else _unframe(raw, "shard record")
        )
        try:
            if legacy:
                manifest = bytes.fromhex(str(data["manifest"]))
                part = PartHeader(len(manifest), hashlib.sha256(manifest).digest(), inline=manifest)
            else:
                part = PartHeader.from_fields(data, inline)
            return cls(
                index=int(data["index"]),
                count=int(data["count"]),
                holder=str(data["holder"]),
                part=part,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"malformed shard record: {exc}") from exc


def _frame(data: dict[str, Any], tail: bytes) -> bytes:
    return json.dumps(data, sort_keys=True).encode() + b"\n" + tail


def _unframe(raw: bytes, what: str) -> tuple[dict[str, Any], bytes]:
    head, newline, tail = raw.partition(b"\n")
    if not newline:
        raise InvalidArgument(f"malformed {what}: no header line")
    return _load(head, what), tail


def _load(raw: bytes, what: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise InvalidArgument(f"malformed {what}: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidArgument(f"malformed {what}: not an object")
    return data
