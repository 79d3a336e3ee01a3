"""Manifests in etcd: paged outside the watched prefix, committed atomically, read back checked.

A version's manifest can be 10 MB (100,000 tensors, 300,000 chunks) while etcd refuses any
request over 1.5 MiB and any transaction over 128 operations (its defaults, which we never
raise). So a manifest of more than `INLINE_BYTES` is cut into pages of at most `PAGE_BYTES`:

1. `stage` writes the pages, one put each, under the publisher's session lease, at
   `mp/{model}/{version}/{part}/{writer}/{page}` (`consistency.keys`): outside the model's
   watched prefix, so no watch carries them, and under a random `writer` id per publish, so
   racing publishers of one version never touch each other's pages. A publisher that dies
   before committing leaves nothing once its lease expires.
2. The publish transaction (`consistency.versions`) adds `Staged.compares` (every page still
   exists: its lease has not expired) and `Staged.commits` (every page re-put with
   `ignore_value` and lease 0: detached from the lease without resending its bytes), and puts
   the small header (`records.PartHeader`: size, SHA-256, page count, writer) at the
   version's manifest key. Pages and header become durable in one commit: no reader can see a
   header whose pages are missing, and a lost race leaves pages only under the lease, which
   `discard` deletes at once (unless the header that won is ours).
3. `read` fetches header and pages in one read-only transaction (one snapshot, one round
   trip) and checks the size and digest before returning a byte.

A group publish's shard manifests (`PublishShards`) are not paged: each goes, compressed, in
the pack its batch writes in its own transaction (`consistency.manifest_packs`); `read` and
`load` find a shard's manifest there when its record names a pack.

Bounds, checked before anything is written: `MAX_MANIFEST_BYTES` (48 pages of 1 MiB, under
the hub's 64 MiB message limit) and `MAX_SHARDS`. The largest transaction is a shard's publish
of a model's first version: 4 + 48 compares; 4 puts, the quota fence, 48 page re-puts and a
nested transaction of 2 (etcd counts those against the parent's 128), well under 128.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from consistency import manifest_packs, ops
from consistency.etcd import Etcd, TxnResult
from consistency.keys import Keys
from consistency.ops import KV
from consistency.records import PartHeader, ShardRecord
from tensorhub.errors import (
    IntegrityError,
    InvalidArgument,
    LeaseLost,
    ManifestTooLarge,
    SessionExpired,
    TensorHubError,
    VersionNotFound,
)

log = logging.getLogger(__name__)

PAGE_BYTES = 1 << 20  # one put each: under etcd's default 1.5 MiB request limit with room
MAX_MANIFEST_PAGES = 48  # page compares + re-puts in one transaction (etcd: 128 ops)
MAX_MANIFEST_BYTES = MAX_MANIFEST_PAGES * PAGE_BYTES  # 48 MiB, under the hub's 64 MiB messages
INLINE_BYTES = 64 << 10  # a whole version's manifest up to this stays in its header
SHARD_INLINE_BYTES = 1 << 10  # per shard: 4,096 shard records stay a small range read
MAX_SHARDS = 4096  # docs/design.md, "Scale envelope"


def written_before_batch(size: int, packed: bool) -> bool:
    """Whether a shard manifest of `size` bytes is written (paged) before its batch: one
    larger than `SHARD_INLINE_BYTES`, unless `packed` (a group publish's) and small enough
    for its batch's pack (`consistency.manifest_packs`). Only such a publish writes anything
    before its batch, so only it checks its session and budget first."""
    if packed and manifest_packs.packable(size, SHARD_INLINE_BYTES):
        return False
    return size > SHARD_INLINE_BYTES


def check_manifest_size(size: int, what: str = "manifest") -> None:
    """`ManifestTooLarge` (nothing written yet) if `size` bytes exceed `MAX_MANIFEST_BYTES`."""
    if size > MAX_MANIFEST_BYTES:
        raise ManifestTooLarge(
            f"{what} is {size} bytes; the limit is {MAX_MANIFEST_BYTES} bytes "
            f"({MAX_MANIFEST_PAGES} etcd pages of {PAGE_BYTES}): use larger chunks, or shards"
        )


def check_shard_count(count: int) -> None:
    """`InvalidArgument` unless 1 <= count <= `MAX_SHARDS` (checked before any work)."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_SHARDS:
        raise InvalidArgument(
            f"shard count {count!r} out of range: a version has 1 to {MAX_SHARDS} shards"
        )


@dataclass(frozen=True)
class ManifestHeader:
    """What a reader needs to know about a version's manifest before reading it.

    `size` and `digest` (SHA-256) are the whole manifest's; of a model-parallel version
    (`shard_count` > 0) `size` is the sum over shards, `digest` the SHA-256 of the shards'
    digests in order, and `shards` holds each shard's own header (`manifest(shard=i)`
    reads one). `published_revision` is the etcd revision at which the version became visible.
    `session`: the session that published a whole version (0: not recorded, or
    model-parallel: each of `shards` names its own).
    """

    published_revision: int
    size: int
    digest: bytes
    shard_count: int = 0
    shards: tuple[PartHeader, ...] = ()
    whole: PartHeader | None = field(default=None, repr=False)
    session: int = 0

    def publisher(self, shard: int | None) -> int:
        """The session that published the whole version (`shard` None) or shard `shard`
        of it; 0 if not recorded, or if there is no such part."""
        if shard is None:
            return 0 if self.shard_count else self.session
        return self.shards[shard].session if 0 <= shard < len(self.shards) else 0


@dataclass(frozen=True)
class Staged:
    """A manifest ready to commit: its header, and what the publish transaction must add."""

    header: PartHeader
    compares: list[ops.Cmp]
    commits: list[ops.Op]
    prefix: str = ""  # the writer's page prefix; "" when the manifest is inline

    def count_op(self) -> list[ops.Op]:
        """For the transaction's failure branch: how many of our pages are still there."""
        return [ops.get(self.prefix, prefix=True, count_only=True)] if self.prefix else []

    def check_pages(self, result: TxnResult, what: str) -> None:
        """After a failed publish transaction: `LeaseLost` if our pages vanished with the
        lease (retrying cannot succeed then), else nothing (a lost race: try again)."""
        if not self.prefix or result.succeeded:
            return
        if int(result.responses[-1].response_range.count) < self.header.pages:
            raise LeaseLost(
                f"the manifest pages of {what} vanished before the publish committed: "
                "the publisher's session (lease) expired"
            )


class ManifestStore:
    """Stores, reads and pages manifests for one key prefix (see the module docstring)."""

    def __init__(self, etcd: Etcd, keys: Keys) -> None:
        self.etcd = etcd
        self.keys = keys

    # -- write -----------------------------------------------------------------------------

    def stage(
        self,
        tenant: str,
        model: str,
        version: int,
        part: int | None,
        manifest: bytes,
        lease: int,
        *,
        timeout: float,
        owner: str | None = None,
    ) -> Staged:
        """Write `manifest`'s pages under `lease` (none if small enough to stay inline).

        `owner` (the tenant's record of that lease's session) is compared in each page's
        write: no page goes under a lease that is not one of the tenant's live sessions
        (`SessionExpired`, nothing left behind)."""
        check_manifest_size(len(manifest))
        digest = hashlib.sha256(manifest).digest()
        if len(manifest) <= (INLINE_BYTES if part is None else SHARD_INLINE_BYTES):
            return Staged(PartHeader(len(manifest), digest, inline=manifest), [], [])
        writer = secrets.token_hex(8)
        prefix = self.keys.manifest_writer(tenant, model, version, part, writer)
        deadline = time.monotonic() + timeout
        compares: list[ops.Cmp] = []
        commits: list[ops.Op] = []
        view = memoryview(manifest)
        try:
            owned = [ops.exists(owner)] if owner is not None else []
            for page, start in enumerate(range(0, len(manifest), PAGE_BYTES)):
                key = f"{prefix}{page:06d}"
                written = self.etcd.txn(
                    owned,
                    [ops.put(key, bytes(view[start : start + PAGE_BYTES]), lease)],
                    timeout=max(deadline - time.monotonic(), 0.01),
                )  # a retried put writes the same bytes: idempotent
                if not written.succeeded:
                    raise SessionExpired(
                        f"session {lease:x} has expired or was revoked: open a new one"
                    )
                compares.append(ops.exists(key))
                commits.append(ops.put(key, ignore_value=True))  # lease 0: detached, bytes kept
        except TensorHubError:
            # No header names these pages yet: deleting them is always safe (and if etcd is
            # unreachable now, they go with the lease).
            self._drop(prefix, [], [ops.delete(prefix, prefix=True)], [])
            raise
        header = PartHeader(len(manifest), digest, pages=len(compares), writer=writer)
        return Staged(header, compares, commits, prefix)

    def discard(self, staged: Staged, owner_key: str, owner_value: bytes, timeout: float) -> None:
        """Delete staged pages unless `owner_key` holds `owner_value` (then they are live).

        Best effort after a publish that definitely failed: the pages are still under the
        publisher's lease, so anything left here goes when that lease does.
        """
        if not staged.prefix:
            return
        drop = ops.delete(staged.prefix, prefix=True)
        self._drop(
            staged.prefix,
            [ops.absent(owner_key)],
            [drop],
            [ops.nested([ops.value(owner_key, "!=", owner_value)], [drop])],
            timeout,
        )

    def _drop(
        self,
        prefix: str,
        compare: list[ops.Cmp],
        success: list[ops.Op],
        failure: list[ops.Op],
        timeout: float = 5.0,
    ) -> None:
        """Delete staged pages, best effort: what is left goes when the lease does."""
        try:
            self.etcd.txn(compare, success, failure, timeout=timeout)
        except TensorHubError as exc:
            log.warning("could not delete staged manifest pages %s: %s", prefix, exc)

    # -- read ------------------------------------------------------------------------------

    def header(
        self, tenant: str, model: str, version: int, *, timeout: float | None = None
    ) -> ManifestHeader:
        """The version's header (and its shards' headers): one read, no pages."""
        keys = self.keys
        result = self.etcd.txn(
            [],
            [
                ops.get(keys.manifest(tenant, model, version)),
                ops.get(keys.shards(tenant, model, version), prefix=True),
            ],
            timeout=timeout,
        )
        top, shard_kvs = (_kvs(r) for r in result.responses)
        return self.parse(model, version, top, [ShardRecord.decode(kv.value) for kv in shard_kvs])

    def read(
        self,
        tenant: str,
        model: str,
        version: int,
        shard: int | None = None,
        *,
        timeout: float | None = None,
    ) -> bytes:
        """The manifest of a whole version, or of shard `shard` of a model-parallel one.

        One read-only transaction reads the header, the shard record and the pages at one
        revision. `VersionNotFound` if the version is not published (or was collected),
        `IntegrityError` if the bytes do not match the header's size and digest.
        """
        keys = self.keys
        prefix = keys.manifest_part(tenant, model, version, shard)
        reads = [ops.get(keys.manifest(tenant, model, version)), ops.get(prefix, prefix=True)]
        if shard is not None:
            reads.append(ops.get(keys.shard(tenant, model, version, shard)))
        responses = self.etcd.txn([], reads, timeout=timeout).responses
        top, pages = _kvs(responses[0]), _kvs(responses[1])
        if not top:
            raise VersionNotFound(f"{model}@{version} is not published (or no longer retained)")
        head = PartHeader.decode(top[0].value)
        if shard is None:
            if head.shards:
                raise InvalidArgument(
                    f"{model}@{version} is model-parallel ({head.shards} shards): "
                    "read one shard's manifest"
                )
            return self.assemble(head, pages, prefix, f"{model}@{version}")
        if not head.shards:
            raise InvalidArgument(f"{model}@{version} is not model-parallel: it has no shards")
        if shard >= head.shards:
            raise InvalidArgument(
                f"shard {shard} out of range: {model}@{version} has {head.shards}"
            )
        records = _kvs(responses[2])
        if not records:
            raise VersionNotFound(f"{model}@{version} has no record of shard {shard}")
        part = ShardRecord.decode(records[0].value).part
        what = f"shard {shard} of {model}@{version}"
        if part.pack:  # a pack is written once, with the record: a second read finds it
            key = keys.manifest_pack(tenant, model, version, part.pack)
            packs = self.etcd.range(key, timeout=timeout).kvs
            if not packs:
                raise VersionNotFound(f"{model}@{version} is no longer retained")
            return manifest_packs.unpack(part, packs[0].value, what)
        return self.assemble(part, pages, prefix, what)

    def load(
        self,
        tenant: str,
        model: str,
        version: int,
        parts: dict[int | None, PartHeader],
        revision: int,
        *,
        timeout: float | None = None,
    ) -> dict[int | None, bytes]:
        """The bytes of several parts of one version as of `revision` (one range read, and
        only if some part is paged): for `describe`, which read the headers at `revision`."""
        pages: list[KV] = []
        if any(p.pages or p.pack for p in parts.values()):
            pages = self.etcd.range(
                self.keys.manifest_pages(tenant, model, version),
                prefix=True,
                revision=revision,
                timeout=timeout,
            ).kvs
        packs = {kv.key: kv.value for kv in pages}  # a pack is found by its exact key
        result: dict[int | None, bytes] = {}
        for part, header in parts.items():
            prefix = self.keys.manifest_part(tenant, model, version, part)
            what = f"{model}@{version}" if part is None else f"shard {part} of {model}@{version}"
            if header.pack:
                key = ops.b(self.keys.manifest_pack(tenant, model, version, header.pack))
                if key not in packs:
                    raise IntegrityError(f"the manifest of {what} has no pack")
                result[part] = manifest_packs.unpack(header, packs[key], what)
            else:
                result[part] = self.assemble(header, pages, prefix, what)
        return result

    @staticmethod
    def assemble(header: PartHeader, pages: list[KV], prefix: str, what: str) -> bytes:
        """The manifest `header` describes, from its inline bytes or from `pages` (any
        superset: only its writer's under the part's `prefix` count, in key order), checked
        against the header's size and digest."""
        if header.pages:
            mine = ops.b(f"{prefix}{header.writer}/")
            own = sorted((kv for kv in pages if kv.key.startswith(mine)), key=lambda kv: kv.key)
            if len(own) != header.pages:
                raise IntegrityError(
                    f"the manifest of {what} has {len(own)} of its {header.pages} pages"
                )
            data = b"".join(kv.value for kv in own)
        else:
            data = header.inline
        if len(data) != header.size or hashlib.sha256(data).digest() != header.digest:
            raise IntegrityError(
                f"the manifest of {what} does not match its header "
                f"({len(data)} bytes, header says {header.size} and another digest)"
            )
        return data

    @staticmethod
    def parse(
        model: str, version: int, top: list[KV], records: list[ShardRecord]
    ) -> ManifestHeader:
        """A `ManifestHeader` from the version's header key and all its shard records."""
        if not top:
            raise VersionNotFound(f"{model}@{version} is not published (or no longer retained)")
        kv = top[0]
        head = PartHeader.decode(kv.value)
        if not head.shards:
            return ManifestHeader(
                kv.create_revision, head.size, head.digest, whole=head, session=head.session
            )
        if len(records) != head.shards or any(r.count != head.shards for r in records):
            raise VersionNotFound(f"{model}@{version} has inconsistent shard records")
        parts = tuple(r.part for r in sorted(records, key=lambda r: r.index))
        return ManifestHeader(
            kv.create_revision,
            sum(p.size for p in parts),
            hashlib.sha256(b"".join(p.digest for p in parts)).digest(),
            head.shards,
            parts,
        )


def _kvs(response: Any) -> list[KV]:
    return [KV.from_pb(kv) for kv in response.response_range.kvs]
