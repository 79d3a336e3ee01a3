"""Batches of one version's shards (`consistency.shard_commit`), against a real etcd: one
transaction per batch, visibility exactly once with the last shard, each failure alone."""

from __future__ import annotations

import json
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consistency import Etcd, HolderRecord, Session, VersionRegistry
from consistency.manifests import PAGE_BYTES
from consistency.shard_entries import FIXED_OPS, MAX_BATCH, MAX_TXN_OPS, ShardEntry, take
from consistency.usage import RECORD_BYTES, TenantBudget, Usage
from tensorhub.errors import (
    AlreadyExists,
    InvalidArgument,
    LeaseLost,
    QuotaExceeded,
    SessionExpired,
    StaleVersion,
)
from tests.consistency.shards import publish_shard


def rec(session: int, name: str) -> HolderRecord:
    return HolderRecord(name, {"tcp": "127.0.0.1:9"}, session=session)


def stage(
    versions: VersionRegistry, model: str, index: int, count: int, session: int, body: bytes = b""
) -> ShardEntry:
    manifest = body or f"part{index}".encode()
    return versions.stage_shard(
        "t", model, 1, index, count, manifest, rec(session, f"rank{index}"), timeout=10
    )


def latest(versions: VersionRegistry, model: str) -> int:
    return versions.latest("t", model)[0]


def test_a_batch_is_one_transaction_and_the_last_makes_the_version_visible(
    etcd: Etcd, versions: VersionRegistry
) -> None:
    count = 3 * MAX_BATCH + 5
    with Session(etcd, ttl=10) as session:
        queue = [stage(versions, "mp", i, count, session.id) for i in range(count)]
        committer = versions.shard_committer("t", "mp", 1)
        revisions: list[int] = []
        before = versions.latest("t", "mp")[1]
        batches = 0
        while queue:
            batch = take(queue)
            batches += 1
            assert len(batch) == min(len(batch) + len(queue), (MAX_TXN_OPS - FIXED_OPS) // 2)
            outcomes = committer.commit(batch)
            assert all(not isinstance(o, Exception) for o in outcomes), outcomes
            revision = {o.revision for o in outcomes}  # type: ignore[union-attr]
            assert len(revision) == 1  # the whole batch: one transaction
            revisions.append(revision.pop())
            visible = {o.visible for o in outcomes}  # type: ignore[union-attr]
            assert visible == {not queue}  # visible exactly with the batch of the last shard
            assert latest(versions, "mp") == (0 if queue else 1)
        assert versions.latest("t", "mp")[1] - before == batches  # a revision per batch
        assert batches == math.ceil(count / ((MAX_TXN_OPS - FIXED_OPS) // 2))
        info = versions.describe("t", "mp", 1)
        assert [s.index for s in info.shards] == list(range(count))
        assert [s.manifest for s in info.shards] == [f"part{i}".encode() for i in range(count)]
        assert len([h for h in info.holders if h.complete]) == count


def test_take_respects_etcds_operation_limit_and_one_entry_per_index(
    etcd: Etcd, versions: VersionRegistry
) -> None:
    paged = b"x" * (PAGE_BYTES * 20)  # 20 pages: 22 puts each
    with Session(etcd, ttl=10) as session:
        queue = [stage(versions, "ops", i, 8, session.id, paged) for i in range(8)]
        queue.append(stage(versions, "ops", 0, 8, session.id))  # index 0 again
        batch = take(queue)
        assert sum(e.ops for e in batch) + FIXED_OPS <= MAX_TXN_OPS
        assert len(batch) == 5  # 5 * 22 + 5 <= 128 < 6 * 22 + 5
        assert [e.index for e in queue] == [5, 6, 7, 0]  # the second index 0 waits
        outcomes = versions.shard_committer("t", "ops", 1).commit(batch)
        assert not any(isinstance(o, Exception) for o in outcomes)


def test_a_dead_session_in_a_batch_fails_alone_and_leaves_nothing(
    etcd: Etcd, versions: VersionRegistry
) -> None:
    """etcd refuses a whole transaction that writes under a missing lease: the batch finds
    the dead sessions, fails their shards alone, and commits the others. A paged shard's
    pages went with the lease (LeaseLost: the compare on its pages fails); an inline one's
    holder record names the dead lease (SessionExpired, after etcd refuses the batch)."""
    count = 6
    live = Session(etcd, ttl=10)
    dying = [Session(etcd, ttl=2), Session(etcd, ttl=2)]
    paged = b"p" * (PAGE_BYTES + 10)  # staged under the dying lease: pages to vanish
    entries = [stage(versions, "dead", i, count, live.id) for i in range(count) if i not in (3, 4)]
    entries.insert(3, stage(versions, "dead", 3, count, dying[0].id, paged))
    entries.insert(4, stage(versions, "dead", 4, count, dying[1].id))
    for session in dying:
        session.orphan()
        etcd.lease_revoke(session.id)  # its session dies while its shard waits in the batch
    outcomes = versions.shard_committer("t", "dead", 1).commit(entries)
    assert type(outcomes[3]) is LeaseLost, outcomes[3]
    assert isinstance(outcomes[4], SessionExpired), outcomes[4]
    assert all(not isinstance(o, Exception) for i, o in enumerate(outcomes) if i not in (3, 4))
    assert latest(versions, "dead") == 0  # shards 3 and 4 missing: not visible
    keys = versions.keys
    for index in (3, 4):
        assert etcd.get(keys.shard("t", "dead", 1, index))[0] is None
        assert etcd.get(keys.holder("t", "dead", 1, f"rank{index}"))[0] is None
        assert etcd.count(keys.manifest_part("t", "dead", 1, index)) == 0  # nothing orphaned
    # A new session publishes the two missing shards and makes the version visible.
    with Session(etcd, ttl=10) as again:
        assert not publish_shard(
            versions, "t", "dead", 1, 3, count, b"p3", rec(again.id, "rank3")
        ).visible
        assert publish_shard(
            versions, "t", "dead", 1, 4, count, b"p4", rec(again.id, "rank4")
        ).visible
        assert latest(versions, "dead") == 1
    live.close()


def test_failures_in_a_batch_are_each_entrys_own(etcd: Etcd, versions: VersionRegistry) -> None:
    with Session(etcd, ttl=10) as session:
        publish_shard(versions, "t", "mix", 1, 0, 4, b"p0", rec(session.id, "rank0"))
        batch = [
            stage(versions, "mix", 1, 4, session.id),
            stage(versions, "mix", 2, 5, session.id),  # another shard count
            versions.stage_shard("t", "mix", 1, 0, 4, b"p0", rec(session.id, "intruder")),
            stage(versions, "mix", 3, 4, session.id),
        ]
        outcomes = versions.shard_committer("t", "mix", 1).commit(batch)
        assert isinstance(outcomes[1], InvalidArgument)
        assert "5 shards" in str(outcomes[1])
        assert "say 4" in str(outcomes[1])
        assert isinstance(outcomes[2], AlreadyExists)
        assert not isinstance(outcomes[0], Exception)
        assert not isinstance(outcomes[3], Exception)
        assert latest(versions, "mix") == 0  # shard 2 is still missing
        last = publish_shard(versions, "t", "mix", 1, 2, 4, b"p2", rec(session.id, "rank2"))
        assert last.visible
        assert latest(versions, "mix") == 1
        # A newer version makes what is left of this one stale.
        with pytest.raises(StaleVersion):
            publish_shard(versions, "t", "mix", 1, 9, 10, b"x", rec(session.id, "late"))


def test_a_retried_shard_is_idempotent(etcd: Etcd, versions: VersionRegistry) -> None:
    """A publish whose reply was lost, sent again (restaged: new pages), succeeds with the
    first write's revision, and the second attempt's pages are deleted."""
    paged = b"r" * (PAGE_BYTES + 1)
    with Session(etcd, ttl=10) as session:
        first = publish_shard(versions, "t", "retry", 1, 0, 2, paged, rec(session.id, "rank0"))
        again = publish_shard(versions, "t", "retry", 1, 0, 2, paged, rec(session.id, "rank0"))
        assert again.revision == first.revision
        assert not again.visible
        part = versions.keys.manifest_part("t", "retry", 1, 0)
        assert etcd.count(part) == 2  # the first write's two pages; the retry's are gone
        assert publish_shard(versions, "t", "retry", 1, 1, 2, b"p1", rec(session.id, "r1")).visible
        assert versions.manifest("t", "retry", 1, 0) == paged


def test_the_budget_admits_a_batch_prefix(etcd: Etcd, versions: VersionRegistry) -> None:
    """A batch charges the tenant once; the shards past its budget fail with QuotaExceeded
    and the rest land."""
    tenant_budget = TenantBudget(
        etcd, versions.keys, "t", max_bytes=3 * 1100, publishes_per_minute=600
    )

    class Quarter:
        key = tenant_budget.key

        def charge(self, sizes, usage, arrived):  # type: ignore[no-untyped-def]
            return tenant_budget.charge_read(sizes, usage, 0.25)

    with Session(etcd, ttl=10) as session:
        batch = [stage(versions, "quota", i, 4, session.id) for i in range(4)]
        outcomes = versions.shard_committer("t", "quota", 1, budget=Quarter()).commit(batch)
        assert [type(o).__name__ for o in outcomes][3] == "QuotaExceeded"
        assert isinstance(outcomes[3], QuotaExceeded)
        assert not any(isinstance(o, Exception) for o in outcomes[:3])
        assert latest(versions, "quota") == 0


def test_an_expired_entry_is_not_written(etcd: Etcd, versions: VersionRegistry) -> None:
    with Session(etcd, ttl=10) as session:
        entry = stage(versions, "late", 0, 1, session.id)
        entry.deadline = time.monotonic() - 1
        (outcome,) = versions.shard_committer("t", "late", 1).commit([entry])
        assert type(outcome).__name__ == "DeadlineExceeded"
        assert etcd.get(versions.keys.shard("t", "late", 1, 0))[0] is None


def test_a_restarted_rank_holds_the_shard_its_dead_predecessor_committed(
    etcd: Etcd, versions: VersionRegistry
) -> None:
    """A rank killed after its shard committed comes back with a new session and publishes
    the same shard again (same holder name, same bytes): it becomes that shard's holder
    under its new session, its publish succeeds, and the shard is not counted twice. The
    same shard with other bytes is still refused."""
    paged = b"q" * (PAGE_BYTES + 3)
    dead = Session(etcd, ttl=10)
    publish_shard(versions, "t", "again", 1, 0, 2, paged, rec(dead.id, "rank0"))
    dead.close()  # killed: its holder record goes with its lease
    keys = versions.keys
    assert etcd.get(keys.holder("t", "again", 1, "rank0"))[0] is None
    with Session(etcd, ttl=10) as restarted:
        again = publish_shard(versions, "t", "again", 1, 0, 2, paged, rec(restarted.id, "rank0"))
        assert not again.visible
        holder, _ = etcd.get(keys.holder("t", "again", 1, "rank0"))
        assert holder is not None
        assert holder.lease == restarted.id
        assert etcd.count(keys.manifest_part("t", "again", 1, 0)) == 2  # its new pages: gone
        with pytest.raises(AlreadyExists):
            publish_shard(versions, "t", "again", 1, 0, 2, b"other", rec(restarted.id, "rank0"))
        last = publish_shard(versions, "t", "again", 1, 1, 2, b"p1", rec(restarted.id, "rank1"))
        assert last.visible  # counted once: the second shard completes it
        assert versions.manifest("t", "again", 1, 0) == paged


def _take_scanning_all(queue: list[ShardEntry]) -> list[ShardEntry]:
    """`take` as its rules state it, looking at every entry of the queue (the reference the
    scan that stops where the batch is full is held to)."""
    from consistency.shard_entries import PACK_BYTES, view_ops

    batch: list[ShardEntry] = []
    indices: set[int] = set()
    used = FIXED_OPS + view_ops(queue)
    packed = 0
    rest: list[ShardEntry] = []
    for entry in queue:
        more = entry.ops + (1 if entry.packed and not packed else 0)
        if (
            len(batch) < MAX_BATCH
            and entry.index not in indices
            and used + more <= MAX_TXN_OPS
            and (not entry.packed or packed + len(entry.packed) <= PACK_BYTES)
        ):
            batch.append(entry)
            indices.add(entry.index)
            used += more
            packed += len(entry.packed)
        else:
            rest.append(entry)
    queue[:] = rest
    return batch


@settings(max_examples=300, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(
            st.integers(0, 40),  # shard index (repeats: a second publish of an index)
            st.sampled_from([0, 0, 0, 1, 5, 30]),  # pages written before the batch
            st.sampled_from([0, 0, 600, 300_000]),  # packed manifest bytes
            st.sampled_from([0, 0, 0, 1, 2]),  # view shards
        ),
        max_size=300,
    )
)
def test_take_stops_where_the_batch_is_full_and_takes_what_a_whole_scan_takes(
    shapes: list[tuple[int, int, int, int]],
) -> None:
    """A burst queues thousands of shards and `take` looks no further than where its batch
    is full: on queues of repeated indices, paged, packed and view-carrying shards it takes
    the same batch, in the same order, and leaves the same queue, as a scan of the whole
    queue."""
    from types import SimpleNamespace
    from typing import cast

    from consistency.manifests import Staged
    from consistency.shard_entries import ViewShard

    def entry(index: int, pages: int, packed: int, views: int) -> ShardEntry:
        staged = cast(Staged, SimpleNamespace(header=SimpleNamespace(pages=pages)))
        shards = [cast(ViewShard, SimpleNamespace(ops=2 + v)) for v in range(views)]
        return ShardEntry(
            index, 64, rec(1, f"rank{index}"), staged, b"", 1, 0.0, packed=b"p" * packed,
            views=shards,
        )  # fmt: skip

    queue = [entry(*shape) for shape in shapes]
    reference = list(queue)
    while queue or reference:
        batch, expected = take(queue), _take_scanning_all(reference)
        assert [id(e) for e in batch] == [id(e) for e in expected]
        assert [id(e) for e in queue] == [id(e) for e in reference]
        if not batch:
            break


def test_a_shards_parts_of_publisher_checksums_weigh_in_its_batch_by_their_bytes() -> None:
    """A shard's other puts (its parts of declared layouts' publisher checksums) count one
    operation more per `EXTRA_OP_BYTES` of their values, so a batch of shards with large
    parts stays under etcd's request size: two shards of 256 KiB of parts (33 operations
    each, with their own two) fit a batch; 128 shards of it would not."""
    from types import SimpleNamespace
    from typing import cast

    from consistency import ops
    from consistency.manifests import Staged
    from consistency.shard_entries import EXTRA_OP_BYTES, MAX_TXN_OPS
    from tensorhub.declared_records import MAX_PARTS_BYTES

    def entry(index: int, nbytes: int) -> ShardEntry:
        staged = cast(Staged, SimpleNamespace(header=SimpleNamespace(pages=0)))
        return ShardEntry(
            index, 64, rec(1, f"rank{index}"), staged, b"x", 1, 0.0,
            extra=[ops.put(f"/k/{index}", b"v" * nbytes)], extra_bytes=nbytes,
        )  # fmt: skip

    assert entry(0, 0).ops == 3
    heavy = entry(0, MAX_PARTS_BYTES)
    assert heavy.ops == 3 + MAX_PARTS_BYTES // EXTRA_OP_BYTES
    queue = [entry(i, MAX_PARTS_BYTES) for i in range(8)]
    batch = take(queue)
    assert 0 < len(batch) < 8
    assert sum(e.ops for e in batch) <= MAX_TXN_OPS
    assert sum(e.extra_bytes for e in batch) <= MAX_TXN_OPS * EXTRA_OP_BYTES


class _Counted:
    """The committer's etcd client, counting its transactions (each a round trip)."""

    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd
        self.txns = 0

    def txn(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.txns += 1
        return self.etcd.txn(*args, **kwargs)

    def __getattr__(self, name: str) -> object:
        return getattr(self.etcd, name)


def _budget(etcd: Etcd, versions: VersionRegistry) -> object:
    tenant_budget = TenantBudget(
        etcd, versions.keys, "t", max_bytes=1 << 30, publishes_per_minute=1 << 20
    )

    class Whole:
        key = tenant_budget.key

        def charge(self, sizes, usage, arrived):  # type: ignore[no-untyped-def]
            return tenant_budget.charge_read(sizes, usage, 0.25)

    return Whole()


def test_a_versions_next_batch_sends_its_transaction_on_what_the_last_one_wrote(
    etcd: Etcd, versions: VersionRegistry
) -> None:
    """After a batch commits, the version's next batch on the same committer (a hub keeps
    what it carries from one batch to the next) sends its transaction without reading
    first: one round trip a batch instead of two, with its compares (latest, the counter,
    the usage, each shard absent) holding on the state carried; the counter and the usage
    come out as a read of each batch makes them."""
    count = 3 * ((MAX_TXN_OPS - FIXED_OPS) // 2)  # three full batches
    counted = _Counted(etcd)
    with Session(etcd, ttl=10) as session:
        queue = [stage(versions, "carry", i, count, session.id) for i in range(count)]
        held = sum(e.size + RECORD_BYTES for e in queue)
        committer = versions.shard_committer("t", "carry", 1, budget=_budget(etcd, versions))  # type: ignore[arg-type]
        committer.etcd = counted  # type: ignore[assignment]
        txns: list[int] = []
        while queue:
            before = counted.txns
            outcomes = committer.commit(take(queue))
            assert all(not isinstance(o, Exception) for o in outcomes), outcomes
            txns.append(counted.txns - before)
        assert txns == [2, 1, 1]  # the first reads; the next two carry
        assert committer.carried is None  # the version is visible: nothing more to carry
        assert latest(versions, "carry") == 1
        counter, _ = etcd.get(versions.keys.shard_arrivals("t", "carry", 1))
        assert counter is not None
        assert json.loads(counter.value) == {"count": count, "arrived": count}
        usage, _ = etcd.get(_budget(etcd, versions).key)  # type: ignore[attr-defined]
        assert usage is not None
        assert Usage.decode(usage.value).held == held


def test_a_stale_carried_state_falls_back_to_the_read(
    etcd: Etcd, versions: VersionRegistry
) -> None:
    """A carried state that another committer (another replica's batch) or an earlier
    write (a retried shard) made stale decides nothing: the transaction on it fails its
    compares, and the batch reads and commits as without it. The version becomes visible
    once, with its last shard, and a retried shard gets its first write's revision."""
    count = 6
    with Session(etcd, ttl=10) as session:
        mine = versions.shard_committer("t", "stale", 1)
        other = versions.shard_committer("t", "stale", 1)
        first = mine.commit([stage(versions, "stale", i, count, session.id) for i in (0, 1)])
        assert mine.carried is not None
        assert not any(isinstance(o, Exception) for o in other.commit(
            [stage(versions, "stale", i, count, session.id) for i in (2, 3)]
        ))  # fmt: skip
        # `mine` carries a counter that `other` moved, and shard 0 is its own earlier write
        outcomes = mine.commit([stage(versions, "stale", i, count, session.id) for i in (0, 4)])
        assert not any(isinstance(o, Exception) for o in outcomes), outcomes
        assert outcomes[0].revision == first[0].revision  # type: ignore[union-attr]
        assert latest(versions, "stale") == 0
        last = mine.commit([stage(versions, "stale", 5, count, session.id)])
        assert last[0].visible  # type: ignore[union-attr]
        assert latest(versions, "stale") == 1
        counter, _ = etcd.get(versions.keys.shard_arrivals("t", "stale", 1))
        assert counter is not None
        assert json.loads(counter.value) == {"count": count, "arrived": count}
        info = versions.describe("t", "stale", 1)
        assert [s.index for s in info.shards] == list(range(count))


def test_a_refusal_on_a_carried_state_is_decided_again_on_a_read(
    etcd: Etcd, versions: VersionRegistry
) -> None:
    """A budget that refuses shards of a batch tried on a carried state does not have the
    last word: the batch reads and the budget decides on what it read, and only that
    decision counts (`budget_refused`, what the hub's refusal metric adds)."""
    tenant_budget = TenantBudget(
        etcd, versions.keys, "t", max_bytes=3 * (6 + RECORD_BYTES), publishes_per_minute=600
    )

    class Bytes:
        key = tenant_budget.key

        def charge(self, sizes, usage, arrived):  # type: ignore[no-untyped-def]
            return tenant_budget.charge_read(sizes, usage, 0.25)

    counted = _Counted(etcd)
    with Session(etcd, ttl=10) as session:
        committer = versions.shard_committer("t", "full", 1, budget=Bytes())
        committer.etcd = counted  # type: ignore[assignment]
        first = committer.commit([stage(versions, "full", i, 5, session.id) for i in (0, 1)])
        assert not any(isinstance(o, Exception) for o in first)
        assert committer.carried is not None
        before = counted.txns
        outcomes = committer.commit([stage(versions, "full", i, 5, session.id) for i in (2, 3, 4)])
        assert not isinstance(outcomes[0], Exception)
        assert [type(o) for o in outcomes[1:]] == [QuotaExceeded, QuotaExceeded]
        assert counted.txns - before == 2  # no transaction on the carried state: a read, one
        assert committer.budget_refused == 2  # the read's refusals, each once
        assert latest(versions, "full") == 0
