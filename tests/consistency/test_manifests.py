"""Manifests at the scale envelope (docs/design.md), against a real etcd at its default limits.

100,000 tensors / 300,000 chunks (about 11 MB) and 4,096 shards must publish and read back
with etcd's default `--max-request-bytes` (1.5 MiB) and `--max-txn-ops` (128), which the
embedded members never raise; a publisher that dies half-way must leave nothing behind; the
limits must refuse before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from consistency import (
    Etcd,
    EtcdCluster,
    HolderRecord,
    HolderRegistry,
    Keys,
    Session,
    VersionRegistry,
)
from consistency.manifests import (
    INLINE_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_PAGES,
    MAX_SHARDS,
    PAGE_BYTES,
    SHARD_INLINE_BYTES,
)
from consistency.quota import CountedCreate
from consistency.shard_entries import FULL_BATCH, ShardEntry, take
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import (
    DeadlineExceeded,
    InvalidArgument,
    LeaseLost,
    LeaseNotFound,
    ManifestTooLarge,
    OutcomeUnknown,
    StaleVersion,
    TensorHubError,
    Unavailable,
)
from tests.consistency.shards import publish_shard
from tests.waiting import wait_until


@pytest.fixture
def session(etcd: Etcd) -> Iterator[Session]:
    with Session(etcd, ttl=10) as s:
        yield s


def rec(session_id: int, name: str = "trainer") -> HolderRecord:
    return HolderRecord(name, {"tcp": "127.0.0.1:9"}, {"dc": "dc1"}, session=session_id)


def big_manifest(tensors: int = 100_000, chunks: int = 300_000) -> bytes:
    """A realistic manifest: MoE-style tensor names, bf16 shapes, one xxh3 per chunk; valid
    by `ros.manifest_check` (the tensors fill the flat space: 3 MiB each at the defaults)."""
    manifest = pb.Manifest(total_bytes=chunks << 20, chunk_size=1 << 20)
    offset = 0
    rows = (chunks << 20) // tensors // (1536 * 2)
    for i in range(tensors):
        nbytes = rows * 1536 * 2
        manifest.tensors.add(
            name=f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.down_proj.weight",
            dtype="bfloat16",
            shape=[rows, 1536],
            offset=offset,
            nbytes=nbytes,
        )
        offset += nbytes
    manifest.chunk_xxh3.extend((i * 0x9E3779B97F4A7C15) & (2**64 - 1) for i in range(chunks))
    return manifest.SerializeToString()


def _everything(etcd: Etcd, keys: Keys) -> list[bytes]:
    return [kv.key for kv in etcd.range(keys.tenant("t"), prefix=True, keys_only=True).kvs]


def _pages(etcd: Etcd, keys: Keys, model: str, version: int) -> list[bytes]:
    prefix = keys.manifest_pages("t", model, version)
    return [kv.key for kv in etcd.range(prefix, prefix=True, keys_only=True).kvs]


def test_a_300k_chunk_manifest_publishes_and_reads_back_byte_identical(
    etcd: Etcd, versions: VersionRegistry, session: Session
) -> None:
    manifest = big_manifest()
    assert len(manifest) > 9_000_000  # about 11 MB: far over etcd's 1.5 MiB request limit
    started = time.monotonic()
    published = versions.publish("t", "big", 1, manifest, rec(session.id))
    publish_s = time.monotonic() - started
    assert published.visible
    started = time.monotonic()
    assert versions.manifest("t", "big", 1) == manifest
    read_s = time.monotonic() - started
    header = versions.header("t", "big", 1)
    assert (header.size, header.digest) == (len(manifest), hashlib.sha256(manifest).digest())
    assert header.published_revision == published.revision
    assert header.shard_count == 0
    assert versions.describe("t", "big", 1).manifest == manifest  # what Inspect shows
    # The pages are durable (lease 0) and outside the watched model prefix; what is inside
    # it (header, latest, holder) is small.
    pages = etcd.range(versions.keys.manifest_pages("t", "big", 1), prefix=True).kvs
    assert len(pages) == -(-len(manifest) // PAGE_BYTES)
    assert all(kv.lease == 0 and len(kv.value) <= PAGE_BYTES for kv in pages)
    watched = etcd.range(versions.keys.model("t", "big"), prefix=True).kvs
    assert sum(len(kv.value) for kv in watched) < 4096
    print(
        f"\n{len(manifest)} B manifest in {len(pages)} pages: "
        f"publish {publish_s:.2f}s, read {read_s:.2f}s"
    )


def test_small_manifests_stay_inline(
    etcd: Etcd, versions: VersionRegistry, session: Session
) -> None:
    versions.publish("t", "small", 1, b"m" * INLINE_BYTES, rec(session.id))
    assert _pages(etcd, versions.keys, "small", 1) == []
    assert versions.manifest("t", "small", 1) == b"m" * INLINE_BYTES


def test_a_publisher_whose_lease_expires_before_the_commit_leaves_nothing(
    etcd: Etcd, versions: VersionRegistry
) -> None:
    """The publisher dies after writing its pages: they go with its lease, nothing shows."""
    lease, _ = etcd.lease_grant(1)  # never kept alive: the publisher is dead
    staged = versions.manifests.stage(
        "t", "dead", 1, None, b"x" * (3 * PAGE_BYTES), lease, timeout=5
    )
    assert staged.header.pages == 3
    assert len(_pages(etcd, versions.keys, "dead", 1)) == 3
    assert versions.latest("t", "dead")[0] == 0  # pages alone publish nothing
    wait_until("the pages expired", lambda: not _pages(etcd, versions.keys, "dead", 1))
    assert _everything(etcd, versions.keys) == []


def test_a_lease_lost_between_pages_and_commit_fails_the_publish_cleanly(
    etcd: Etcd, versions: VersionRegistry
) -> None:
    """The lease is revoked after the pages are written and before the transaction: the
    transaction finds its pages gone and says so (no retrying until the deadline)."""
    lease, _ = etcd.lease_grant(30)

    def lose_lease(_: float) -> tuple[list[object], list[object]]:
        etcd.lease_revoke(lease)  # asked inside the attempt, after the pages are written
        return [], []

    with pytest.raises(LeaseLost, match="vanished"):
        versions.publish(
            "t", "lost", 1, b"y" * (2 * PAGE_BYTES), rec(lease), timeout=5, admit_model=lose_lease
        )
    assert versions.latest("t", "lost")[0] == 0
    assert _everything(etcd, versions.keys) == []


def test_racing_paged_publishes_of_one_version_leave_only_the_winners_pages(
    etcd: Etcd, versions: VersionRegistry, session: Session
) -> None:
    barrier = threading.Barrier(2)
    manifests = {n: n.encode() * (PAGE_BYTES // 2 + 1) for n in ("aa", "bb")}  # 2 pages

    def publish(name: str) -> str:
        barrier.wait()
        try:
            versions.publish("t", "race", 1, manifests[name], rec(session.id, name))
        except StaleVersion:
            return ""
        return name

    with ThreadPoolExecutor(2) as pool:
        winners = [w for w in pool.map(publish, manifests) if w]
    assert len(winners) == 1
    assert versions.manifest("t", "race", 1) == manifests[winners[0]]
    assert len(_pages(etcd, versions.keys, "race", 1)) == 2  # the loser's are deleted


def test_retention_deletes_a_versions_pages_with_it(
    etcd: Etcd, versions: VersionRegistry, session: Session
) -> None:
    for version in (1, 2, 3):
        versions.publish("t", "ret", version, bytes([version]) * (PAGE_BYTES + 1), rec(session.id))
    assert _pages(etcd, versions.keys, "ret", 1) == []
    assert len(_pages(etcd, versions.keys, "ret", 3)) == 2
    assert versions.versions("t", "ret") == [2, 3]


def test_limits_are_refused_before_anything_is_written(
    etcd: Etcd, versions: VersionRegistry, session: Session
) -> None:
    too_big = b"z" * (MAX_MANIFEST_BYTES + 1)
    with pytest.raises(ManifestTooLarge, match=f"{len(too_big)} bytes; the limit is"):
        versions.publish("t", "huge", 1, too_big, rec(session.id))
    with pytest.raises(ManifestTooLarge, match=str(MAX_MANIFEST_BYTES)):
        publish_shard(versions, "t", "huge", 1, 0, 2, too_big, rec(session.id))
    for count in (0, MAX_SHARDS + 1):
        with pytest.raises(InvalidArgument, match=f"1 to {MAX_SHARDS} shards"):
            publish_shard(versions, "t", "huge", 1, 0, count, b"p", rec(session.id))
    assert _everything(etcd, versions.keys) == []


def _publish_shards(
    versions: VersionRegistry, model: str, count: int, session_id: int, paged: set[int]
) -> list[bool]:
    """Every shard of `model`@1 as the hub commits a group call's: staged on 8 threads, then
    committed in the batches `take` makes (4 at once); whether each made the version
    visible, in commit order."""

    def part(i: int) -> bytes:
        return f"shard-{i}-".encode() * (400 if i in paged else 1)

    def stage(i: int) -> ShardEntry:
        holder = rec(session_id, f"rank{i}")
        return versions.stage_shard("t", model, 1, i, count, part(i), holder, timeout=60)

    def commit(batch: list[ShardEntry]) -> list[bool]:
        visible = []
        for outcome in versions.shard_committer("t", model, 1).commit(batch):
            if isinstance(outcome, TensorHubError):
                raise outcome
            visible.append(outcome.visible)
        return visible

    with ThreadPoolExecutor(8) as pool:
        staged = list(pool.map(stage, range(count)))
    batches = []
    while staged:
        batches.append(take(staged))
    with ThreadPoolExecutor(4) as pool:
        return [v for visible in pool.map(commit, batches) for v in visible]


def test_4096_shards_publish_within_default_txn_ops(
    etcd: Etcd, versions: VersionRegistry, session: Session
) -> None:
    paged = {0, 1, MAX_SHARDS - 1}  # a few shards big enough to be paged
    assert len(b"shard-0-" * 400) > SHARD_INLINE_BYTES
    started = time.monotonic()
    visible = _publish_shards(versions, "mp", MAX_SHARDS, session.id, paged)
    elapsed = time.monotonic() - started
    # exactly one batch, the last to commit, moved latest: its shards are told so
    assert 1 <= visible.count(True) <= FULL_BATCH
    assert versions.latest("t", "mp")[0] == 1
    header = versions.header("t", "mp", 1)
    assert header.shard_count == MAX_SHARDS
    assert len(header.shards) == MAX_SHARDS
    assert [i for i, p in enumerate(header.shards) if p.pages] == sorted(paged)
    for i in (0, 7, MAX_SHARDS - 1):
        expected = f"shard-{i}-".encode() * (400 if i in paged else 1)
        assert versions.manifest("t", "mp", 1, i) == expected
    with pytest.raises(InvalidArgument, match="model-parallel"):
        versions.manifest("t", "mp", 1)
    print(f"\n{MAX_SHARDS} shards published in {elapsed:.1f}s")


def test_a_version_missing_one_shard_stays_invisible(
    etcd: Etcd, versions: VersionRegistry, session: Session
) -> None:
    count = 200  # more shards than one transaction could compare (the old design's limit)
    for i in range(1, count):
        assert not publish_shard(
            versions, "t", "gap", 1, i, count, b"p", rec(session.id, f"r{i}")
        ).visible
    assert versions.latest("t", "gap")[0] == 0
    assert versions.versions("t", "gap") == []
    last = publish_shard(versions, "t", "gap", 1, 0, count, b"p", rec(session.id, "r0"))
    assert last.visible
    assert versions.latest("t", "gap")[0] == 1


def test_a_shard_at_the_size_limit_fits_one_transaction_with_the_quota_fence(
    etcd: Etcd, versions: VersionRegistry, session: Session
) -> None:
    """The largest transaction there is: 48 pages, the model quota's fence, the counter and
    the nested transaction that moves `latest`, all within etcd's default 128 operations."""
    quota = CountedCreate(
        etcd, versions.keys.quota_fence("t", "models"), 10, lambda t: versions.models("t"), "models"
    )
    manifest = bytes(range(256)) * (MAX_MANIFEST_BYTES // 256)
    assert len(manifest) == MAX_MANIFEST_BYTES
    published = publish_shard(
        versions,
        "t",
        "max",
        1,
        0,
        1,
        manifest,
        rec(session.id),
        admit_model=lambda t: quota.admit(t, "max"),
    )
    assert published.visible
    assert versions.header("t", "max", 1).shards[0].pages == MAX_MANIFEST_PAGES
    assert versions.manifest("t", "max", 1, 0) == manifest


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_paged_publishes_through_a_leader_kill_are_whole_or_absent() -> None:
    """Publishes of paged manifests while the leader dies: retried (ambiguous) attempts find
    their own success, every acknowledged version reads back byte-identical, every version
    that shows at all is complete, and no page outlives the session unless its version shows."""
    keys = Keys("/test/paged-kill")
    acked: list[int] = []
    unknown: list[int] = []

    def manifest(version: int) -> bytes:
        return bytes([version % 256]) * (PAGE_BYTES + version)  # two pages each

    with EtcdCluster(size=3) as cluster:
        leader = cluster.leader(timeout=30)
        endpoints = cluster.endpoints
        first = [endpoints[leader]] + [e for i, e in enumerate(endpoints) if i != leader]
        with Etcd(first, timeout=5) as etcd:
            versions = VersionRegistry(etcd, keys, retain=1000)
            stop = threading.Event()
            with Session(etcd, ttl=10) as session:

                def publish_until_stopped() -> None:
                    version = 0
                    while not stop.is_set():
                        version += 1
                        try:
                            versions.publish(
                                "t", "m", version, manifest(version), rec(session.id), timeout=5
                            )
                        except (OutcomeUnknown, Unavailable, DeadlineExceeded):
                            unknown.append(version)
                            continue
                        acked.append(version)

                thread = threading.Thread(target=publish_until_stopped, daemon=True)
                thread.start()
                wait_until("5 publishes acknowledged", lambda: len(acked) >= 5, timeout=30)
                cluster.kill(leader)
                killed_at = len(acked)
                wait_until("5 more after the kill", lambda: len(acked) >= killed_at + 5, timeout=60)
                stop.set()
                thread.join(timeout=20)
                assert not thread.is_alive()
            # The session is closed (its lease revoked): staged pages of publishes that did
            # not commit are gone with it.
            shown = versions.versions("t", "m")
            assert set(acked) <= set(shown) <= set(acked) | set(unknown)
            for version in shown:
                assert versions.manifest("t", "m", version) == manifest(version)
            everything = etcd.range(f"{keys.tenant('t')}mp/m/", prefix=True, keys_only=True)
            paged = {int(kv.key.decode().split("/")[-4]) for kv in everything.kvs}
            assert paged == set(shown)


def test_a_publish_under_a_dead_session_writes_nothing(
    etcd: Etcd, versions: VersionRegistry
) -> None:
    lease, _ = etcd.lease_grant(30)
    etcd.lease_revoke(lease)
    with pytest.raises(LeaseNotFound):
        versions.publish("t", "gone", 1, b"g" * (2 * PAGE_BYTES), rec(lease), timeout=5)
    assert _everything(etcd, versions.keys) == []


def test_a_rank_naming_another_shard_count_is_refused_and_writes_nothing(
    etcd: Etcd, versions: VersionRegistry, session: Session
) -> None:
    publish_shard(versions, "t", "mix", 1, 0, 2, b"p" * 2048, rec(session.id, "r0"))
    before = _everything(etcd, versions.keys)
    with pytest.raises(InvalidArgument, match="say 2"):
        publish_shard(versions, "t", "mix", 1, 1, 3, b"q" * 2048, rec(session.id, "r1"))
    assert _everything(etcd, versions.keys) == before  # its pages too
    assert publish_shard(versions, "t", "mix", 1, 1, 2, b"q", rec(session.id, "r1")).visible


def test_versions_written_before_headers_still_read(
    etcd: Etcd, versions: VersionRegistry, holders: HolderRegistry, session: Session
) -> None:
    """What the previous release wrote (the manifest as the value; shard records with their
    part in hex and a `{"sharded": n}` marker) reads as inline headers after an upgrade."""
    keys = versions.keys
    old = pb.Manifest(total_bytes=4, chunk_size=4, chunk_xxh3=[7]).SerializeToString()
    etcd.put(keys.manifest("t", "old", 1), old)
    etcd.put(keys.latest("t", "old"), "1")
    assert versions.manifest("t", "old", 1) == old
    assert versions.header("t", "old", 1).digest == hashlib.sha256(old).digest()
    assert versions.describe("t", "old", 1).manifest == old
    for i in range(2):
        part = json.dumps(
            {"count": 2, "holder": f"r{i}", "index": i, "manifest": f"0{i}".encode().hex()}
        )
        etcd.put(keys.shard("t", "oldmp", 1, i), part)
    etcd.put(keys.manifest("t", "oldmp", 1), json.dumps({"sharded": 2}))
    assert versions.header("t", "oldmp", 1).shard_count == 2
    assert versions.manifest("t", "oldmp", 1, 1) == b"01"
    assert [s.manifest for s in versions.describe("t", "oldmp", 1).shards] == [b"00", b"01"]
    with pytest.raises(InvalidArgument, match="must name its shard"):
        holders.register("t", "oldmp", 1, rec(session.id, "reader"))
