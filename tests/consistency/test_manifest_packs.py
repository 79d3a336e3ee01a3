"""Packs (`consistency.manifest_packs`): a group publish's shard manifests written, compressed,
in their batch's own transaction, against a real etcd. A batch of packed shards is one
transaction and one revision, nothing is written before it; every reader of a shard's
manifest (read, describe) finds it and checks it; a lost reply's retry writes nothing; a
refused shard leaves nothing; retention deletes the packs with their version."""

from __future__ import annotations

import hashlib
import math
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from consistency import Etcd, HolderRecord, Session, VersionRegistry, manifest_packs
from consistency.manifest_packs import PACK_BYTES, SHARD_PACK_BYTES
from consistency.manifests import SHARD_INLINE_BYTES
from consistency.records import PartHeader, ShardRecord
from consistency.shard_entries import FULL_BATCH, MAX_TXN_OPS, ShardEntry, take
from tensorhub.errors import AlreadyExists, IntegrityError, InvalidArgument


def revision_of(etcd: Etcd) -> int:
    """etcd's revision now (a read of any key answers it)."""
    return etcd.get("/probe")[1]


def rec(session: int, name: str) -> HolderRecord:
    return HolderRecord(name, {"tcp": "127.0.0.1:9"}, session=session)


def layer(index: int, tensors: int = 60) -> bytes:
    """A shard's manifest bytes: large enough to be paged were it not packed."""
    return b"".join(f"model.layers.{index}.proj_{t}.weight:float32:64x64;".encode()
                    for t in range(tensors))  # fmt: skip


def stage(
    versions: VersionRegistry, model: str, index: int, count: int, session: int, body: bytes
) -> ShardEntry:
    return versions.stage_shard(
        "t", model, 1, index, count, body, rec(session, f"rank{index}"), timeout=10, pack=True
    )


def _packs(etcd: Etcd, versions: VersionRegistry, model: str, version: int = 1) -> list[bytes]:
    prefix = f"{versions.keys.manifest_pages('t', model, version)}pack/"
    return [kv.key for kv in etcd.range(prefix, prefix=True).kvs]


def test_packed_shards_commit_one_revision_per_batch_and_every_reader_finds_them(
    etcd: Etcd, versions: VersionRegistry
) -> None:
    count = 2 * FULL_BATCH + 7
    bodies = [layer(i) for i in range(count)]
    assert min(len(b) for b in bodies) > SHARD_INLINE_BYTES  # each would be paged alone
    with Session(etcd, ttl=10) as session:
        before = revision_of(etcd)
        queue = [stage(versions, "mp", i, count, session.id, bodies[i]) for i in range(count)]
        assert revision_of(etcd) == before  # staging a packed shard writes nothing
        committer = versions.shard_committer("t", "mp", 1)
        batches = 0
        while queue:
            batch = take(queue)
            batches += 1
            assert len(batch) == min(len(batch) + len(queue), FULL_BATCH)
            outcomes = committer.commit(batch)
            assert all(not isinstance(o, Exception) for o in outcomes), outcomes
        assert batches == math.ceil(count / FULL_BATCH)
        assert revision_of(etcd) - before == batches  # packs ride in the batches
        assert len(_packs(etcd, versions, "mp")) == batches
        assert etcd.count(versions.keys.manifest_part("t", "mp", 1, 0)) == 0  # no pages
        assert versions.latest("t", "mp")[0] == 1
        for i in (0, FULL_BATCH, count - 1):  # one read of a shard's manifest
            assert versions.manifest("t", "mp", 1, i) == bodies[i]
        info = versions.describe("t", "mp", 1)  # every shard's, at one revision
        assert [s.manifest for s in info.shards] == bodies
        header = versions.header("t", "mp", 1)
        assert all(p.pack and not p.pages and not p.inline for p in header.shards)
        assert [p.size for p in header.shards] == [len(b) for b in bodies]


def test_a_retried_batch_writes_nothing_and_another_holders_shard_is_refused(
    etcd: Etcd, versions: VersionRegistry
) -> None:
    count = 4
    bodies = [layer(i) for i in range(count)]
    with Session(etcd, ttl=10) as session:
        entries = [stage(versions, "re", i, count, session.id, bodies[i]) for i in range(3)]
        first = versions.shard_committer("t", "re", 1).commit(entries)
        revision = revision_of(etcd)
        again = [stage(versions, "re", i, count, session.id, bodies[i]) for i in range(3)]
        assert versions.shard_committer("t", "re", 1).commit(again) == first  # idempotent
        assert revision_of(etcd) == revision  # found, not written again
        other = versions.stage_shard(
            "t", "re", 1, 0, count, layer(99), rec(session.id, "impostor"), timeout=10, pack=True
        )
        outcome = versions.shard_committer("t", "re", 1).commit([other])[0]
        assert isinstance(outcome, AlreadyExists)
        assert revision_of(etcd) == revision  # a refused shard writes nothing
        assert len(_packs(etcd, versions, "re")) == 1
        assert versions.latest("t", "re")[0] == 0  # 3 of 4: nothing visible
        last = stage(versions, "re", 3, count, session.id, bodies[3])
        assert versions.shard_committer("t", "re", 1).commit([last])[0].visible  # type: ignore[union-attr]
        assert versions.manifest("t", "re", 1, 3) == bodies[3]


def test_a_pack_that_does_not_match_its_record_is_an_integrity_error(
    etcd: Etcd, versions: VersionRegistry
) -> None:
    with Session(etcd, ttl=10) as session:
        entry = stage(versions, "bad", 0, 1, session.id, layer(0))
        versions.shard_committer("t", "bad", 1).commit([entry])
        (key,) = _packs(etcd, versions, "bad")
        etcd.put(key, b"\x00" * 40)  # by hand: not what the record says
        with pytest.raises(IntegrityError):
            versions.manifest("t", "bad", 1, 0)
        with pytest.raises(IntegrityError):
            versions.describe("t", "bad", 1)


def test_retention_deletes_a_versions_packs_with_it(etcd: Etcd, versions: VersionRegistry) -> None:
    with Session(etcd, ttl=10) as session:
        for version in range(1, versions.retain + 2):
            entry = versions.stage_shard(
                "t", "ret", version, 0, 1, layer(version), rec(session.id, "r0"), timeout=10,
                pack=True,
            )  # fmt: skip
            assert versions.shard_committer("t", "ret", version).commit([entry])[0].visible  # type: ignore[union-attr]
        versions.collect("t", "ret")
        assert _packs(etcd, versions, "ret", 1) == []
        assert len(_packs(etcd, versions, "ret", versions.retain + 1)) == 1


def test_take_keeps_a_batch_within_one_pack_and_etcds_operation_limit(
    etcd: Etcd, versions: VersionRegistry
) -> None:
    with Session(etcd, ttl=10) as session:
        big = [
            stage(versions, "big", i, 8, session.id, random.Random(i).randbytes(SHARD_PACK_BYTES))
            for i in range(8)
        ]  # incompressible: each about 256 KiB stored
        batch = take(list(big))
        assert sum(len(e.packed) for e in batch) <= PACK_BYTES
        assert 1 <= len(batch) < 8
        small = [stage(versions, "small", i, 200, session.id, layer(i)) for i in range(200)]
        batch = take(small)
        assert len(batch) == FULL_BATCH
        assert 5 + 2 * len(batch) + 1 <= MAX_TXN_OPS  # the batch's puts, its pack included
        over = versions.stage_shard(
            "t", "over", 1, 0, 1, b"x" * (SHARD_PACK_BYTES + 1), rec(session.id, "r"),
            timeout=10, pack=True,
        )  # fmt: skip
        assert over.packed == b""  # paged, as ever
        assert over.staged.header.pages == 1


def test_a_packed_header_round_trips_and_a_malformed_one_is_refused() -> None:
    header = PartHeader(100, b"\x01" * 32, session=7, pack="abcd", offset=10, stored=40)
    assert PartHeader.decode(header.encode()) == header
    record = ShardRecord(3, 4, "rank3", header)
    assert ShardRecord.decode(record.encode()).part == header
    with pytest.raises(InvalidArgument):
        PartHeader.decode(PartHeader(100, b"\x01" * 32, pack="abcd", stored=0).encode())


def test_manifests_compressed_on_many_threads_at_once_each_decompress_to_their_own() -> None:
    """A group call stages its chunks in several workers at once: each thread compresses with
    its own compressor (one shared across threads is not safe: zstd refuses or mixes its
    inputs), so every stored manifest comes back as it went in."""
    bodies = [layer(i, 200) for i in range(256)]
    with ThreadPoolExecutor(8) as pool:
        packed = list(pool.map(manifest_packs.compress, bodies * 4))
    for body, stored in zip(bodies * 4, packed, strict=True):
        header = PartHeader(len(body), hashlib.sha256(body).digest(), pack="p", offset=0,
                            stored=len(stored))  # fmt: skip
        assert manifest_packs.unpack(header, stored, "a shard") == body
