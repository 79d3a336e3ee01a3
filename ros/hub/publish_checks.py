"""What a publish's request is checked for before any work, apart from the replica: the
scale envelope's bounds, the publisher's checksums of declared layouts (a whole version's, a
shard's parts), how a refusal names the manifest, and what the shards of one
`PublishShards` call share (`CallChecks`).

These checks read only the request (and, for `CallChecks`, what its first shard found), so
they live apart from the handlers that call them (`ros.hub.rpc_publish`). Importing this
module sets the publish-limit gauges (`HUB_PUBLISH_LIMIT`) the refusal metric is read
against.
"""

from __future__ import annotations

from consistency import VersionRegistry
from consistency.manifests import (
    MAX_MANIFEST_BYTES,
    MAX_SHARDS,
    check_manifest_size,
    check_shard_count,
)
from consistency.publishing import Admit
from consistency.sessions import SessionRecords
from ros.hub.rpc import Registries
from ros.hub.tenants import Tenant
from ros.metrics import HUB_PUBLISH_LIMIT, HUB_PUBLISHES_REFUSED
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.declared_records import (
    MAX_PART_SUMS,
    MAX_PARTS_BYTES,
    MAX_PARTS_SHARDS,
    MAX_PUBLISHER_SUMS,
    Part,
    encode_parts,
)
from tensorhub.errors import InvalidArgument
from tensorhub.names import validate_name

HUB_PUBLISH_LIMIT.labels("manifest_bytes").set(MAX_MANIFEST_BYTES)
HUB_PUBLISH_LIMIT.labels("shards").set(MAX_SHARDS)


class CallChecks:
    """What the shards of one `PublishShards` call share, worked out for its first shard
    and reused by the rest (thousands of shards of one version): the model and version as
    checked, with the model quota's admission, by the (model, version) the request named
    (the rest of a call's shards of another version are refused by `ros.hub.shard_group`
    before their checks); the tenant's version registry; each session's key. Only what
    passed is kept, so a refused shard's successor is checked in full again; what depends
    on the shard itself (its limits, its holder, its manifest) is checked every time."""

    def __init__(self, *, deferred: bool = False) -> None:
        """`deferred`: its shards' manifests are checked in a checking process, each
        chunk's before it is staged (`ros.hub.deferred_checks`)."""
        self.deferred = deferred
        self.version: dict[tuple[str, int], tuple[str, int, Admit]] = {}
        self._versions: tuple[Tenant, VersionRegistry] | None = None
        self._sessions: dict[tuple[str, int], str] = {}

    def versions(self, hub: Registries, tenant: Tenant) -> VersionRegistry:
        """`hub.versions(tenant)`, looked up once a call (a call's caller is one tenant)."""
        if self._versions is None or self._versions[0] is not tenant:
            self._versions = (tenant, hub.versions(tenant))
        return self._versions[1]

    def session_key(self, sessions: SessionRecords, tenant: str, session: int) -> str:
        """`sessions.key(tenant, session)`, made once a session."""
        key = self._sessions.get((tenant, session))
        if key is None:
            key = self._sessions[(tenant, session)] = sessions.key(tenant, session)
        return key


def check_publish_limits(request: pb.PublishRequest, size: int | None = None) -> None:
    """The scale envelope's bounds (docs/design.md), before any work: `InvalidArgument` past
    `MAX_SHARDS`,
    `ManifestTooLarge` past `MAX_MANIFEST_BYTES` (counted in the refusal metric by limit).
    `size`: the manifest's bytes, where the caller has them counted."""
    limit = "shards"
    try:
        if request.shard_count:
            check_shard_count(request.shard_count)
        limit = "manifest_bytes"
        check_manifest_size(request.manifest.ByteSize() if size is None else size)
    except InvalidArgument:
        HUB_PUBLISHES_REFUSED.labels(limit).inc()
        raise


def layout_sums(request: pb.PublishRequest) -> dict[str, dict[str, list[int]]]:
    """A whole publish's checksums of its declared layouts' block sets, checked: names,
    each block set once, at most `MAX_PUBLISHER_SUMS` in all (`InvalidArgument`)."""
    out: dict[str, dict[str, list[int]]] = {}
    total = 0
    for entry in request.layout_sums:
        sets = out.setdefault(validate_name(entry.layout, "layout"), {})
        block_set = validate_name(entry.block_set, "block set")
        if block_set in sets or len(block_set) != 32:
            raise InvalidArgument(
                f"publisher checksums of block set {block_set!r}: one 32-digit id, once"
            )
        total += len(entry.sums)
        if total > MAX_PUBLISHER_SUMS:
            raise InvalidArgument(f"over {MAX_PUBLISHER_SUMS} publisher checksums in one publish")
        sets[block_set] = list(entry.sums)
    return out


def layout_parts(request: pb.PublishRequest) -> bytes:
    """A shard's parts of the publisher's checksums of declared layouts, checked (names,
    lengths, at most `MAX_PART_SUMS` sums, at most `MAX_PARTS_SHARDS` shards) and encoded
    with the declarations' revision its rank read (`InvalidArgument`)."""
    if request.shard_count > MAX_PARTS_SHARDS:
        raise InvalidArgument(
            f"parts of publisher checksums from {request.shard_count} shards: at most "
            f"{MAX_PARTS_SHARDS}"
        )
    parts = []
    total = 0
    for p in request.layout_parts:
        if len(p.chunks) != len(p.sums) or len(p.offsets) != len(p.shape):
            raise InvalidArgument("a part of publisher checksums names as many chunks as sums")
        total += len(p.sums)
        if total > MAX_PART_SUMS:
            raise InvalidArgument(f"over {MAX_PART_SUMS} publisher checksums in one shard")
        parts.append(Part(
            validate_name(p.layout, "layout"), validate_name(p.block_set, "block set"),
            p.tensor, (tuple(p.offsets), tuple(p.shape)), tuple(p.chunks), tuple(p.sums),
        ))  # fmt: skip
    encoded = encode_parts(request.declared_revision, request.shard_count, parts)
    if len(encoded) > MAX_PARTS_BYTES:
        raise InvalidArgument(
            f"a shard's parts of publisher checksums take {len(encoded)} bytes: at most "
            f"{MAX_PARTS_BYTES}"
        )
    return encoded


def manifest_name(request: pb.PublishRequest) -> str:
    """How a refusal names the manifest of a publish (the SDK names it the same way)."""
    return f"manifest of shard {request.shard_index}" if request.shard_count else "manifest"
