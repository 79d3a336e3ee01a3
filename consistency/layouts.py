"""Holders of a layout's blocks in etcd (docs/design-notes.md, "Readers in another layout").

A reader that reads its blocks of model@version in a layout other than the publisher's
(`fetch_slices(layout=...)`) holds them under a key of their own:

```
{tenant}/lb/{model}/{version:020d}/{layout}/s/{block_set}          its blocks and checksums
{tenant}/lb/{model}/{version:020d}/{layout}/h/{block_set}/{name}   a holder, under its lease
{tenant}/lb/{model}/{version:020d}/{layout}/c/{block_set}/{name}   the same, while it is COMPLETE
```

`block_set` names one worker's blocks (a digest of their description: boxes, dtypes and
chunk size), so readers of the same blocks find each other under one prefix, and a Resolve
of them is one bounded range read: O(K) in the holders it answers, whatever the number of
holders. A reader covered by another layout's block sets lists that layout's `s/` keys (at
most `MAX_BLOCK_SETS_READ`) and a few COMPLETE holders of each (their `c/` keys), in two
bounded reads.

A COMPLETE holder's record is also put under `c/` (same value, same lease) by the
transaction that registers it COMPLETE; a PARTIAL registration and the release delete that
key in theirs, and lease expiry takes both. So `c/{block_set}/` lists exactly the COMPLETE
holders of `h/{block_set}/`, and a cover's range of `COVER_HOLDERS_EACH` keys under it names
COMPLETE holders whenever the block set has any, however many PARTIAL holders (readers
still reading) sort before them under `h/`. A bounded window of `h/` keys filtered for
COMPLETE ones could not promise that for any window size; the second key costs each
COMPLETE holder one more small key on its lease and each registration one more operation.

The block set's key (its description and chunk checksums) is written once (create only) by
the first reader that registers COMPLETE, from bytes verified against the publisher's chunk
checksums (by it, or by the holders it read them from); a PARTIAL holder records none. It
is no lease's, and goes with the version (retention and `DeleteModel` delete
`lb/{model}/{version}/` in the transaction that deletes the version). A PARTIAL holder also
pins the version while it reads (`{tenant}/.../pin/lb-{digest of its name}`, on its lease,
put in its registration's transaction), as a PARTIAL holder of a whole version does;
its COMPLETE registration and its release delete that pin. The transaction that
creates it charges it to the tenant's etcd budget (`consistency.usage`) and counts it in the
version's tally (`consistency.layout_tally`), against which `MAX_LAYOUTS_PER_VERSION` and
`MAX_BLOCK_SETS_PER_LAYOUT` are checked before the write; the release of the version or
model gives the tally's bytes back. A holder key is its session's (lease): release, lease
expiry and session close remove it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from consistency import ops
from consistency.etcd import Etcd, TxnResult
from consistency.keys import Keys
from consistency.layout_limits import (
    COVER_HOLDERS_EACH,
    MAX_BLOCK_SETS_PER_LAYOUT,
    MAX_BLOCK_SETS_READ,
    MAX_BLOCK_SUMS,
    MAX_BLOCKS_BYTES,
    MAX_LAYOUT_HOLDERS_READ,
    MAX_LAYOUTS_PER_VERSION,
)
from consistency.layout_records import (
    BlockSetKey,
    CoverSet,
    LayoutHolders,
    decode_block_set,
    encode_block_set,
)
from consistency.layout_tally import LayoutTally
from consistency.parts_sums import PartsSums, block_set_sums
from consistency.records import HolderRecord
from consistency.retry import LAYOUT_RACES, LostRace
from consistency.usage import RECORD_BYTES, TenantBudget
from tensorhub.declared_records import PARTS_PAGE, decode_publisher_sums
from tensorhub.errors import (
    InvalidArgument,
    PermissionDenied,
    QuotaExceeded,
    SessionExpired,
    Unavailable,
    VersionNotFound,
)


def layout_pin_id(holder: str) -> str:
    """The id of the pin a PARTIAL layout holder takes on its version: apart from the
    `pin/{holder}` of a PARTIAL holder of the whole version (another path of the same
    client), and a valid name whatever the holder's length."""
    return "lb-" + hashlib.sha256(holder.encode()).hexdigest()[:32]


class LayoutRegistry:
    """Register, find and release holders of layout blocks, within one tenant's prefix."""

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        budget: TenantBudget | None = None,
        parts: PartsSums | None = None,
    ) -> None:
        """`budget`: the tenant's, charged for each block set's key it creates (None: no
        charge; the tally still counts them, charged 0). `parts`: what the hub's sharded
        versions' parts of the publisher checksums added up to before (None: added up at
        each resolve)."""
        self.etcd = etcd
        self.keys = keys
        self.budget = budget
        self.parts = parts

    def _keys(self, at: BlockSetKey) -> tuple[str, str, str]:
        args = (at.tenant, at.model, at.version, at.layout, at.block_set)
        return (
            self.keys.manifest(at.tenant, at.model, at.version),
            self.keys.layout_block_set(*args),
            self.keys.layout_holders(*args),
        )

    def register(
        self,
        at: BlockSetKey,
        record: HolderRecord,
        sums: list[int],
        *,
        session_key: str,
        blocks: bytes = b"",
        timeout: float | None = None,
    ) -> tuple[int, int, list[int]]:
        """Put `record` under its lease, and the block set's description `blocks` with its
        checksums `sums` if no reader recorded them yet, in one transaction that compares
        the version's manifest and the tenant's record of the session; (fence, revision,
        the checksums recorded). A PARTIAL record also pins the version in that transaction
        (`layout_pin_id`, under its lease) and a COMPLETE one drops that pin.

        A registration that creates the block set's key charges it to the tenant's budget
        and counts it in the version's tally (`_create`); `QuotaExceeded`, with nothing
        written (not the holder key either), past the budget, `MAX_LAYOUTS_PER_VERSION` or
        `MAX_BLOCK_SETS_PER_LAYOUT`. `VersionNotFound`: the version is not published (or
        was retired); `SessionExpired`: the lease is no live session of the tenant."""
        if record.session <= 0:
            raise InvalidArgument("a layout holder record needs its session (lease) id")
        if len(sums) > MAX_BLOCK_SUMS:
            raise InvalidArgument(
                f"{len(sums)} chunk checksums for one block set: at most {MAX_BLOCK_SUMS}"
            )
        if len(blocks) > MAX_BLOCKS_BYTES:
            raise InvalidArgument(
                f"a block set described in {len(blocks)} bytes: at most {MAX_BLOCKS_BYTES}"
            )
        if not sums:
            fence, revision, recorded, _, _ = self._hold(at, record, session_key, timeout)
            return fence, revision, recorded

        def attempt() -> tuple[int, int, list[int]]:
            return self._create(at, record, encode_block_set(blocks, sums), session_key, timeout)

        return LAYOUT_RACES.compare_and_set(
            attempt,
            None if timeout is None else LAYOUT_RACES.deadline(timeout),
            lambda: Unavailable(
                f"recording blocks {at.block_set} of {at.model}@{at.version}: the tenant's "
                "etcd usage or the version's layout tally kept changing"
            ),
        )

    def register_partial(
        self,
        at: BlockSetKey,
        record: HolderRecord,
        *,
        session_key: str,
        timeout: float | None = None,
    ) -> tuple[int, LayoutHolders]:
        """Put `record` (a PARTIAL holder: no checksums, no charge) under its lease and read,
        in the same transaction (so at its revision), what `resolve` reads: the block set's
        holders (the first `MAX_LAYOUT_HOLDERS_READ` keys, this one among them) and its
        recorded checksums; (our fence, what was found). A reader so learns the holders
        registered before it without a second call, and none registered after it can be
        among them (a revision sees no later create). `VersionNotFound` and
        `SessionExpired` as `register`."""
        if record.session <= 0:
            raise InvalidArgument("a layout holder record needs its session (lease) id")
        fence, revision, sums, holders, published = self._hold(
            at, record, session_key, timeout, resolve=True
        )
        return fence, LayoutHolders(holders, sums, revision, published)

    def _hold(
        self,
        at: BlockSetKey,
        record: HolderRecord,
        session_key: str,
        timeout: float | None,
        resolve: bool = False,
    ) -> tuple[int, int, list[int], list[HolderRecord], list[int]]:
        """Put the holder's key, and nothing else (its block set's key exists, or it
        records none): no charge. With `resolve`, also read the block set's holders and its
        publisher checksums (as `resolve` does, at the transaction's revision; else [])."""
        manifest_key, sums_key, holders = self._keys(at)
        key = self._holder_key(at, record.holder)
        writes = [
            ops.put(key, record.encode(), lease=record.session),
            self._pinning(at, record),
            self._marking(at, record),
        ]
        reads = [ops.get(key), ops.get(sums_key)]
        if resolve:
            reads.append(ops.page(holders, "", MAX_LAYOUT_HOLDERS_READ))
            reads += self._publisher_reads(at)
        result = self.etcd.txn(
            [ops.exists(manifest_key), ops.exists(session_key)],
            [*writes, *reads],
            [ops.get(manifest_key, count_only=True)],
            timeout=timeout,
        )
        self._refused(at, record, result)
        answers = result.responses[len(writes) :]  # the reads, in their order
        held, found = answers[0].response_range, answers[1].response_range
        recorded = decode_block_set(bytes(found.kvs[0].value))[1] if found.kvs else []
        records = (
            [
                HolderRecord.decode(bytes(kv.value), int(kv.create_revision))
                for kv in answers[2].response_range.kvs
            ]
            if resolve
            else []
        )
        published = (
            self._publisher_sums(
                answers[3].response_range.kvs,
                answers[4].response_range,
                at,
                result.revision,
                timeout,
            )
            if resolve
            else []
        )
        return int(held.kvs[0].create_revision), result.revision, recorded, records, published

    def _create(
        self,
        at: BlockSetKey,
        record: HolderRecord,
        value: bytes,
        session_key: str,
        timeout: float | None,
    ) -> tuple[int, int, list[int]]:
        """One try at registering a holder whose block set may have no key yet: read (at one
        revision) whether it has one, the version's tally and the tenant's usage. A key
        there (another reader created it): `_hold`, no charge. Else check the bounds and
        the budget, then create the key with the holder, the tally and the charge, comparing
        the tally's and the usage's mod_revision as read and the key's absence: a failed
        compare (another reader's create, a publish, a release) is a `LostRace`, read again."""
        manifest_key, sums_key, _ = self._keys(at)
        tally_key = self.keys.layout_charge(at.tenant, at.model, at.version)
        budget = self.budget
        reads = [ops.get(sums_key, count_only=True), ops.get(tally_key)]
        if budget is not None:
            reads.append(ops.get(budget.key))
        read = self.etcd.txn([], reads, timeout=timeout)
        if int(read.responses[0].response_range.count):
            fence, revision, recorded, _, _ = self._hold(at, record, session_key, timeout)
            return fence, revision, recorded  # another created it
        tallied = read.responses[1].response_range.kvs
        tally = LayoutTally.decode(bytes(tallied[0].value)) if tallied else LayoutTally()
        self._check_bounds(at, tally)
        charged = 0
        compares: list[ops.Cmp] = []
        puts: list[ops.Op] = []
        if budget is not None:
            usage = read.responses[2].response_range.kvs
            admitted, compares, puts, refusal = budget.charge_read(
                [len(value)], usage[0] if usage else None, publishes=0.0
            )
            if not admitted:
                assert refusal is not None
                raise QuotaExceeded(
                    f"layout {at.layout!r} blocks {at.block_set} of {at.model}@{at.version} "
                    f"are not recorded: {refusal}"
                )
            charged = len(value) + RECORD_BYTES
        key = self._holder_key(at, record.holder)
        seen = int(tallied[0].mod_revision) if tallied else 0
        result = self.etcd.txn(
            [
                ops.exists(manifest_key),
                ops.exists(session_key),
                ops.absent(sums_key),
                ops.mod(tally_key, "==", seen),
                *compares,
            ],
            [
                ops.put(key, record.encode(), lease=record.session),
                self._pinning(at, record),
                self._marking(at, record),
                ops.put(sums_key, value),
                ops.put(tally_key, tally.add(at.layout, charged).encode()),
                *puts,
                ops.get(key),
            ],
            [ops.get(manifest_key, count_only=True), ops.get(session_key, count_only=True)],
            timeout=timeout,
        )
        if budget is not None:
            budget.committed(result.revision if result.succeeded else None)
        if not result.succeeded:
            if all(int(r.response_range.count) for r in result.responses):
                raise LostRace(f"the usage of tenant {at.tenant} or its layout tally moved")
            self._refused(at, record, result)
        held = result.responses[-1].response_range
        return int(held.kvs[0].create_revision), result.revision, decode_block_set(value)[1]

    @staticmethod
    def _refused(at: BlockSetKey, record: HolderRecord, result: TxnResult) -> None:
        """Name why a registration's transaction did not commit (its failure branch read
        the manifest's count first): `VersionNotFound` or `SessionExpired`."""
        if result.succeeded:
            return
        if not int(result.responses[0].response_range.count):
            raise VersionNotFound(f"{at.model}@{at.version} is not published; cannot hold it")
        raise SessionExpired(
            f"session {record.session:x} has expired or was revoked: open a new one"
        )

    @staticmethod
    def _check_bounds(at: BlockSetKey, tally: LayoutTally) -> None:
        """`QuotaExceeded` if one more block set of `at.layout` would pass
        `MAX_BLOCK_SETS_PER_LAYOUT`, or a new layout `MAX_LAYOUTS_PER_VERSION`."""
        if at.layout not in tally.layouts and len(tally.layouts) >= MAX_LAYOUTS_PER_VERSION:
            raise QuotaExceeded(
                f"{at.model}@{at.version} has {MAX_LAYOUTS_PER_VERSION} layouts: layout "
                f"{at.layout!r} is not recorded"
            )
        if tally.sets(at.layout) >= MAX_BLOCK_SETS_PER_LAYOUT:
            raise QuotaExceeded(
                f"layout {at.layout!r} of {at.model}@{at.version} has "
                f"{MAX_BLOCK_SETS_PER_LAYOUT} block sets: no more are recorded"
            )

    def _pin_key(self, at: BlockSetKey, holder: str) -> str:
        """The pin a PARTIAL holder of a block set of the version takes (`layout_pin_id`)."""
        return self.keys.pin(at.tenant, at.model, at.version, layout_pin_id(holder))

    def _pinning(self, at: BlockSetKey, record: HolderRecord) -> ops.Op:
        """A PARTIAL record pins its version (under its lease: retention keeps the version
        while the reader fills its blocks, with no Pin and Unpin calls of its own); a
        COMPLETE one drops that pin, as a holder of a whole version's does."""
        pin = self._pin_key(at, record.holder)
        if record.complete:
            return ops.delete(pin)
        return ops.put(pin, b"", lease=record.session)

    def _complete_key(self, at: BlockSetKey, holder: str) -> str:
        return self.keys.layout_complete_holder(
            at.tenant, at.model, at.version, at.layout, at.block_set, holder
        )

    def _marking(self, at: BlockSetKey, record: HolderRecord) -> ops.Op:
        """A COMPLETE record is put under `c/` too, on its lease (what a cover lists); a
        PARTIAL one deletes it (a holder registered again PARTIAL is listed no more)."""
        key = self._complete_key(at, record.holder)
        if record.complete:
            return ops.put(key, record.encode(), lease=record.session)
        return ops.delete(key)

    def _publisher_reads(self, at: BlockSetKey) -> list[Any]:
        """The reads `_publisher_sums` decodes, in its order: the publisher's checksums of
        the layout's block sets (one key per layout, a whole publish's), and the shards'
        parts of them (a sharded publish's)."""
        keys = self.keys
        return [
            ops.get(keys.publisher_sums(at.tenant, at.model, at.version, at.layout)),
            ops.page(keys.publisher_parts(at.tenant, at.model, at.version), "", PARTS_PAGE),
        ]

    def _publisher_sums(
        self, whole: Sequence[Any], parts: Any, at: BlockSetKey, revision: int,
        timeout: float | None,
    ) -> list[int]:  # fmt: skip
        """The block set's publisher checksums as read at `revision`: from its layout's key
        (a whole publish), else added up from the shards' parts (`parts`: the first page of
        them; `consistency.parts_sums`); []: none."""
        if whole:
            return decode_publisher_sums(bytes(whole[0].value), at.block_set)
        return block_set_sums(
            self.etcd, self.keys.publisher_parts(at.tenant, at.model, at.version), parts,
            revision, self.parts, (at.tenant, at.model, at.version), at.layout, at.block_set,
            timeout,
        )  # fmt: skip

    def _holder_key(self, at: BlockSetKey, holder: str) -> str:
        key = self.keys.layout_holder(
            at.tenant, at.model, at.version, at.layout, at.block_set, holder
        )
        assert key.startswith(self._keys(at)[2])
        return key

    def resolve(self, at: BlockSetKey, *, timeout: float | None = None) -> LayoutHolders:
        """The block set's holders (the first `MAX_LAYOUT_HOLDERS_READ` keys) and checksums,
        in one read transaction; `VersionNotFound` if the version is not published."""
        manifest_key, sums_key, holders = self._keys(at)
        result = self.etcd.txn(
            [],
            [
                ops.get(manifest_key, count_only=True),
                ops.get(sums_key),
                ops.page(holders, "", MAX_LAYOUT_HOLDERS_READ),
                *self._publisher_reads(at),
            ],
            timeout=timeout,
        )
        if not int(result.responses[0].response_range.count):
            raise VersionNotFound(f"{at.model}@{at.version} is not published")
        found = result.responses[1].response_range.kvs
        sums = decode_block_set(bytes(found[0].value))[1] if found else []
        records = [
            HolderRecord.decode(bytes(kv.value), int(kv.create_revision))
            for kv in result.responses[2].response_range.kvs
        ]
        published = self._publisher_sums(
            result.responses[3].response_range.kvs,
            result.responses[4].response_range,
            at,
            result.revision,
            timeout,
        )
        return LayoutHolders(records, sums, result.revision, published)

    def cover(
        self, tenant: str, model: str, version: int, layout: str, *, timeout: float | None = None
    ) -> tuple[list[CoverSet], int]:
        """The block sets of `layout` of model@version (at most `MAX_BLOCK_SETS_READ`) with
        at most `COVER_HOLDERS_EACH` COMPLETE holders of each (a range of its `c/` keys:
        COMPLETE ones whenever it has any, whatever the number of its PARTIAL holders; a
        record's `revision` is its `c/` key's create revision, when it turned COMPLETE) and
        the publisher's checksums of each (a layout declared before the publish; else
        none), and the revision read at, in two bounded reads; `VersionNotFound` if the
        version is not published."""
        manifest_key = self.keys.manifest(tenant, model, version)
        sets = self.keys.layout_block_sets(tenant, model, version, layout)
        first = self.etcd.txn(
            [],
            [ops.get(manifest_key, count_only=True), ops.page(sets, "", MAX_BLOCK_SETS_READ)],
            timeout=timeout,
        )
        if not int(first.responses[0].response_range.count):
            raise VersionNotFound(f"{model}@{version} is not published")
        described = []
        for kv in first.responses[1].response_range.kvs:
            name = bytes(kv.key).decode()[len(sets) :]
            blocks, sums = decode_block_set(bytes(kv.value))
            described.append((name, blocks, sums))
        if not described:
            return [], first.revision
        ranges = [
            ops.page(self.keys.layout_complete_holders(tenant, model, version, layout, name),
                     "", COVER_HOLDERS_EACH)
            for name, _, _ in described
        ]  # fmt: skip
        at = BlockSetKey(tenant, model, version, layout, "")
        second = self.etcd.txn([], [*ranges, *self._publisher_reads(at)], timeout=timeout)
        answers = second.responses[: len(ranges)]
        whole, parts = (r.response_range for r in second.responses[len(ranges) :])
        out = []
        for (name, blocks, sums), answer in zip(described, answers, strict=True):
            holders = [
                HolderRecord.decode(bytes(kv.value), int(kv.create_revision))
                for kv in answer.response_range.kvs
            ]
            published = self._publisher_sums(
                whole.kvs, parts, replace(at, block_set=name), second.revision, timeout
            )
            out.append(CoverSet(name, blocks, sums, holders, published))
        return out, second.revision

    def release(
        self, at: BlockSetKey, holder: str, session: int, *, timeout: float | None = None
    ) -> int:
        """Delete the holder's key, its `c/` key and its pin if `session` owns it (gone
        already: done); `PermissionDenied` if another session's lease holds it."""
        _, _, holders = self._keys(at)
        key = self.keys.layout_holder(
            at.tenant, at.model, at.version, at.layout, at.block_set, holder
        )
        assert key.startswith(holders)
        result = self.etcd.txn(
            [ops.lease(key, "==", session)],
            [
                ops.delete(key),
                ops.delete(self._complete_key(at, holder)),
                ops.delete(self._pin_key(at, holder)),
            ],
            [ops.get(key, count_only=True)],
            timeout=timeout,
        )
        if not result.succeeded and int(result.responses[0].response_range.count):
            raise PermissionDenied(f"layout holder {holder!r} is another session's")
        return result.revision
