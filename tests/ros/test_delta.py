"""Delta versions on a real hub (issue 22; docs/sdk.md, "Delta versions"): a publisher with
`delta=True` publishes each next version also as encoded changes against the one before,
and a reader whose memory holds that one reads only the changes, verified chunk by chunk.
Every fault of item 6 is injected here, each on a real hub over real sockets: a delta holder
killed and one frozen (real processes, SIGKILL and SIGSTOP), a corrupt delta, a destination
that does not hold the base, a base released everywhere, a base never published. Malformed
delta sections are refused by the hub before any write in tests/ros/test_malformed_manifests.py
(their cases are in tests/ros/test_manifest_check.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from prometheus_client import REGISTRY

import ros
from ros.client.deadline import Deadline
from ros.hub.server import HubServer
from tensorhub.delta_rules import companion_of
from tensorhub.errors import InvalidArgument, InvalidManifest

CHUNK = 64 << 10  # small chunks: many of them in a small model
TTL = 3  # the killed process's session: its records outlive it by at most this


def model(seed: int, n: int = 6) -> dict[str, torch.Tensor]:
    """bf16 weights, `n` x 256 KiB."""
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(128 * 1024, generator=g).to(torch.bfloat16) for i in range(n)}


def step(
    weights: dict[str, torch.Tensor], seed: int, share: float = 0.01
) -> dict[str, torch.Tensor]:
    """The next version: `share` of the elements nudged, as an RL step changes ~1 %."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        mask = torch.rand(t.shape, generator=g) < share
        out[name] = torch.where(mask, (t.float() * 1.01).to(torch.bfloat16), t)
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit for bit (bf16 compared as int16: a NaN equals itself, -0 differs from 0)."""
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a
    )


def nbytes(w: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in w.values())


def test_a_reader_applies_each_next_version_from_its_delta(connect: Callable[..., ros.Hub]) -> None:
    trainer, reader = connect(), connect()
    w = model(1)
    trainer.publish("policy", 1, w, chunk_size=CHUNK, delta=True)
    held = reader.fetch("policy", 1)
    assert held.delta is None  # nothing to apply to: read whole
    for v in range(2, 5):
        w = step(w, v)
        pub = trainer.publish("policy", v, w, chunk_size=CHUNK, delta=True)
        assert pub.companion is not None
        tensors = held.tensors
        held.release()
        held = reader.fetch("policy", v, into=tensors)  # the SDK knows this memory holds v-1
        assert same(held.tensors, w)
        assert held.delta is not None
        assert held.delta.base == v - 1, held.delta
        assert held.delta.chunks > 0, held.delta
        assert held.delta.base_mismatch == 0, held.delta
        assert held.delta.encoded_bytes < 0.2 * nbytes(w), held.delta
        # what crossed: the encoded chunks and the chunks sent whole, far less than the model,
        # in one account (Held.stats): the encoded bytes are counted, by who sent them
        assert held.stats.total_bytes < 0.5 * nbytes(w), held.stats
        assert held.stats.encoded_bytes == held.delta.encoded_bytes > 0, held.stats
        assert held.stats.total_bytes >= held.stats.encoded_bytes, held.stats
        assert sum(held.delta.bytes_per_source.values()) == held.delta.encoded_bytes
        for source, sent in held.delta.bytes_per_source.items():
            assert held.stats.bytes_per_source[source] >= sent, held.stats
    assert trainer.delta_memory()["base_copies"] == nbytes(w)  # one copy of the model
    assert 0 < reader.delta_memory()["held_deltas"] < 0.2 * nbytes(w)
    # the reader that applied the delta serves it: its holder record is there
    holders = trainer.holders(companion_of("policy"), 4)
    assert reader.holder_name in {h.holder for h in holders}
    # released with the version: nothing of the delta is served after
    held.release()
    assert reader.holder_name not in {h.holder for h in trainer.holders(companion_of("policy"), 4)}


def _resolves() -> float:
    """Resolve calls this process's hubs have answered so far."""
    return (
        REGISTRY.get_sample_value(
            "tensorhub_hub_requests_total", {"method": "Resolve", "code": "OK"}
        )
        or 0.0
    )


def test_the_companion_is_resolved_with_its_version(connect: Callable[..., ros.Hub]) -> None:
    """A reader applying a delta asks the hub once: the Resolve of v answers its companion
    too (holders, token and manifest, as a Resolve of the companion would), and the
    companion's read uses that answer instead of resolving again."""
    trainer, reader = connect(), connect()
    w = model(7)
    trainer.publish("policy", 1, w, chunk_size=CHUNK, delta=True)
    held = reader.fetch("policy", 1)
    w = step(w, 2)
    trainer.publish("policy", 2, w, chunk_size=CHUNK, delta=True)
    tensors = held.tensors
    held.release()
    before = _resolves()
    held = reader.fetch("policy", 2, into=tensors)
    assert _resolves() - before == 1
    assert held.delta is not None
    assert held.delta.chunks > 0, held.delta
    assert same(held.tensors, w)
    # the answer is what a Resolve of the companion itself gives
    runs = trainer._fetches
    deadline = Deadline.after(30, "test")
    both = runs.resolve("policy", 2, None, deadline, companion=True)
    alone = runs.resolve(companion_of("policy"), 2, None, deadline)
    assert both.HasField("companion")
    assert both.companion.manifest == alone.manifest
    assert both.companion.manifest_digest == alone.manifest_digest
    assert {h.name for h in both.companion.holders} == {h.name for h in alone.holders}
    assert not runs.resolve("policy", 1, None, deadline, companion=True).HasField("companion")


def test_a_reader_several_versions_behind_applies_the_chain(
    connect: Callable[..., ros.Hub],
) -> None:
    trainer, reader = connect(), connect()
    w = model(2)
    trainer.publish("policy", 1, w, chunk_size=CHUNK, delta=True)
    held = reader.fetch("policy", 1)
    held.release()
    for v in (2, 3):
        w = step(w, v)
        trainer.publish("policy", v, w, chunk_size=CHUNK, delta=True)
    again = reader.fetch("policy", 3, into=held.tensors)
    assert same(again.tensors, w)
    assert again.delta is not None
    assert again.delta.links == 2
    assert again.delta.chunks > 0


def test_the_hub_and_the_sdk_keep_the_companion_name_reserved(
    connect: Callable[..., ros.Hub],
) -> None:
    with pytest.raises(InvalidArgument, match="reserved"):
        connect().publish(companion_of("policy"), 1, model(1))


def test_a_publish_that_fails_after_its_encode_leaves_no_base_copy(
    connect: Callable[..., ros.Hub],
) -> None:
    """The encode of v brings the base copy to v as it goes; when v's publish then fails,
    that copy is dropped (it holds what was never published), and the next publish goes
    whole, then deltas resume against it."""
    trainer, reader = connect(), connect()
    w = model(12)
    trainer.publish("policy", 1, w, chunk_size=CHUNK, delta=True)
    w2 = step(w, 13)
    with pytest.raises(InvalidManifest):  # refused after the encode: v's own metadata
        trainer.publish("policy", 2, w2, chunk_size=CHUNK, delta=True, metadata={"": "x"})
    assert trainer.delta_memory()["base_copies"] == 0
    assert trainer.holders(companion_of("policy"), 2) == []  # its companion released
    w3 = step(w2, 14)
    assert trainer.publish("policy", 3, w3, chunk_size=CHUNK, delta=True).companion is None
    held = reader.fetch("policy", 3)
    assert same(held.tensors, w3)
    w4 = step(w3, 15)
    assert trainer.publish("policy", 4, w4, chunk_size=CHUNK, delta=True).companion is not None
    tensors = held.tensors
    held.release()
    held = reader.fetch("policy", 4, into=tensors)
    assert held.delta is not None
    assert held.delta.chunks > 0, held.delta
    assert same(held.tensors, w4)


def test_delta_false_and_a_publisher_without_base_copy_read_whole(
    connect: Callable[..., ros.Hub],
) -> None:
    trainer, reader = connect(), connect()
    w = model(3)
    trainer.publish("policy", 1, w, chunk_size=CHUNK)  # no base copy kept
    held = reader.fetch("policy", 1)
    held.release()
    w = step(w, 2)
    pub = trainer.publish("policy", 2, w, chunk_size=CHUNK, delta=True)
    assert pub.companion is None  # nothing to encode against yet
    held = reader.fetch("policy", 2, into=held.tensors)
    assert held.delta is None
    assert same(held.tensors, w)
    held.release()
    w = step(w, 3)
    trainer.publish("policy", 3, w, chunk_size=CHUNK, delta=True)
    whole = reader.fetch("policy", 3, into=held.tensors, delta=False)
    assert whole.delta is None
    assert same(whole.tensors, w)
    assert whole.stats.total_bytes == nbytes(w)


def test_a_destination_that_is_not_the_base_gets_whole_chunks(
    connect: Callable[..., ros.Hub],
) -> None:
    trainer, reader = connect(), connect()
    w = model(4)
    trainer.publish("policy", 1, w, chunk_size=CHUNK, delta=True)
    held = reader.fetch("policy", 1)
    held.release()
    held.tensors["w2"][7] += 1  # the caller wrote into it after the release
    w = step(w, 2)
    trainer.publish("policy", 2, w, chunk_size=CHUNK, delta=True)
    again = reader.fetch("policy", 2, into=held.tensors)
    assert same(again.tensors, w)  # never a wrong result
    assert again.delta is not None
    assert again.delta.base_mismatch == 1, again.delta
    assert again.delta.chunks > 0


def test_a_base_stated_but_never_published_reads_whole(connect: Callable[..., ros.Hub]) -> None:
    trainer, reader = connect(), connect()
    w = model(5)
    trainer.publish("policy", 1, w, chunk_size=CHUNK, delta=True)
    held = reader.fetch("policy", 1)
    held.release()
    w = step(w, 3)
    trainer.publish("policy", 3, w, chunk_size=CHUNK, delta=True)  # encoded against 1
    again = reader.fetch("policy", 3, into=held.tensors, base=2)  # 2 was never published
    assert same(again.tensors, w)
    assert again.delta is not None
    assert again.delta.chunks == 0
    assert "no chain" in again.delta.fallback, again.delta


def test_a_base_released_everywhere_still_applies(connect: Callable[..., ros.Hub]) -> None:
    """The base's bytes are the reader's own memory, and v's manifest carries the base's
    checksums: nobody needs to hold the base, and its records may be gone."""
    trainer, reader = connect(), connect()
    w = model(6)
    first = trainer.publish("policy", 1, w, chunk_size=CHUNK, delta=True)
    held = reader.fetch("policy", 1)
    held.release(force=True)
    w = step(w, 2)
    trainer.publish("policy", 2, w, chunk_size=CHUNK, delta=True)
    first.release(force=True)
    assert trainer.holders("policy", 1) == []
    again = reader.fetch("policy", 2, into=held.tensors)
    assert same(again.tensors, w)
    assert again.delta is not None
    assert again.delta.chunks > 0


def test_a_corrupt_delta_holder_is_suspected_and_the_chunks_read_whole(
    connect: Callable[..., ros.Hub],
) -> None:
    trainer, middle, reader = connect(), connect(), connect()
    w = model(7)
    trainer.publish("policy", 1, w, chunk_size=CHUNK, delta=True)
    seen = {c: c.fetch("policy", 1) for c in (middle, reader)}
    for held in seen.values():
        held.release()
    w = step(w, 2)
    pub = trainer.publish("policy", 2, w, chunk_size=CHUNK, delta=True)
    bad = middle.fetch("policy", 2, into=seen[middle].tensors)
    assert bad.companion is not None
    assert pub.companion is not None
    pub.companion.release(force=True)  # the corrupt holder is the delta's only holder now
    for blob in bad.companion.tensors.values():
        blob[0] ^= 0xFF  # its memory changed behind its back: it serves other bytes now
    again = reader.fetch("policy", 2, into=seen[reader].tensors)
    assert same(again.tensors, w)
    assert again.delta is not None
    assert again.delta.chunks == 0
    assert "intact" in again.delta.fallback, again.delta


@contextmanager
def delta_holder(hub_server: HubServer, token: str) -> Iterator[subprocess.Popen[str]]:
    """A reader process that applied policy@2's delta and serves it (delta_holder_proc)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.ros.delta_holder_proc", hub_server.address, "team-a",
         token, "policy", "1", "2", "--ttl", str(TTL)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, "the delta holder process exited"
        assert json.loads(line)["delta_chunks"] > 0
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait(10)


def test_a_companion_held_for_one_shard_is_not_used_for_another(
    connect: Callable[..., ros.Hub],
) -> None:
    """A reader that holds shard 0 of a TP version from a delta (and so its companion's
    shard 0) and then reads both shards with `fetch_slices(delta=True)`: shard 1's delta is
    read from shard 1's companion, not taken from the shard 0 companion it holds (whose
    encoded chunks are another shard's), and applies."""
    rows, cols = 512, 256  # per rank: 512 x 128 bf16 = 128 KiB, two chunks of 64 KiB
    full = {"w": torch.randn(rows, cols).to(torch.bfloat16)}
    ranks = [connect(), connect()]
    reader = connect()

    def publish(version: int, weights: dict[str, torch.Tensor]) -> None:
        for r, c in enumerate(ranks):
            part = {"w": weights["w"][:, r * 128 : (r + 1) * 128].contiguous()}
            c.publish(
                "tp", version, part, shard=(r, 2), placements={"w": ((rows, cols), (0, r * 128))},
                chunk_size=CHUNK, delta=True,
            )  # fmt: skip

    def read(version: int) -> tuple[torch.Tensor, ros.SliceFetch]:
        out = torch.empty(rows, cols, dtype=torch.bfloat16)
        got = reader.fetch_slices(
            "tp", version, slices={"w": ros.Slice(out, (0, 0), (rows, cols))}, delta=True
        )
        return out, got

    publish(1, full)
    read(1)  # each shard's staging kept as the base of the next read
    held = reader.fetch("tp", 1, shard=0)
    full = step(full, 2)
    publish(2, full)
    held.release()
    mine = reader.fetch("tp", 2, shard=0, into=held.tensors)
    assert mine.delta is not None
    assert mine.delta.chunks > 0, mine.delta
    assert mine.companion is not None  # this client holds and serves tp.delta@2, shard 0
    second, got = read(2)
    assert torch.equal(second.view(torch.int16), full["w"].view(torch.int16))
    assert set(got.deltas) == {0, 1}
    for shard, stats in got.deltas.items():
        assert stats.chunks > 0, (shard, stats)
        assert not stats.fallback, (shard, stats)
    assert got.deltas[0].encoded_bytes == 0  # shard 0's companion: the one held here
    assert got.deltas[1].encoded_bytes > 0  # shard 1's: read from its holders


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
@pytest.mark.timeout(90)
def test_a_dead_or_frozen_delta_holder_leaves_the_chunks_to_be_read_whole(
    fault: str,
    connect: Callable[..., ros.Hub],
    hub_server: HubServer,
    make_tenant: Callable[[str], str],
) -> None:
    """The delta's only holder is a process that is killed (its lease still names it) or
    frozen (its port accepts and never answers): the reader's read of the delta fails
    within half of what is left of its timeout, and the version's chunks are read whole."""
    token = make_tenant("team-a")
    trainer = ros.connect(hub_server.address, tenant="team-a", token=token)
    reader = ros.connect(hub_server.address, tenant="team-a", token=token)
    try:
        w = model(8)
        trainer.publish("policy", 1, w, chunk_size=CHUNK, delta=True)
        held = reader.fetch("policy", 1)
        held.release()
        w = step(w, 2)
        pub = trainer.publish("policy", 2, w, chunk_size=CHUNK, delta=True)
        with delta_holder(hub_server, token) as proc:
            assert pub.companion is not None
            pub.companion.release(force=True)  # the process is the delta's only holder
            proc.send_signal(getattr(signal, fault))
            start = time.monotonic()
            again = reader.fetch("policy", 2, into=held.tensors, timeout=20)
            took = time.monotonic() - start
        assert same(again.tensors, w)
        assert again.delta is not None
        assert again.delta.chunks == 0, again.delta
        assert "could not be read" in again.delta.fallback, again.delta
        assert took < 20
    finally:
        trainer.close()
        reader.close()


def test_each_shard_of_a_model_parallel_version_has_its_own_delta(
    connect: Callable[..., ros.Hub],
) -> None:
    ranks = [connect(), connect()]
    readers = [connect(), connect()]  # reader rank r reads trainer rank r's shard
    ws = [model(10 + r, n=3) for r in range(2)]
    for r, c in enumerate(ranks):
        c.publish("tp", 1, ws[r], chunk_size=CHUNK, shard=(r, 2), delta=True)
    helds = [readers[r].fetch("tp", 1, shard=r) for r in range(2)]
    ws = [step(w, 20 + r) for r, w in enumerate(ws)]
    for r, c in enumerate(ranks):
        pub = c.publish("tp", 2, ws[r], chunk_size=CHUNK, shard=(r, 2), delta=True)
        assert pub.companion is not None
    for r in range(2):
        helds[r].release()
        again = readers[r].fetch("tp", 2, shard=r, into=helds[r].tensors)
        assert same(again.tensors, ws[r])
        assert again.delta is not None
        assert again.delta.chunks > 0, again.delta
        assert again.shard == r


def test_fetch_slices_in_another_layout_applies_deltas_to_its_kept_staging(
    connect: Callable[..., ros.Hub],
) -> None:
    """TP 2 publishers, a reader of the whole model through `fetch_slices(delta=True)`: the
    second read applies each source shard's delta to the staging copy the first one kept,
    and the blocks it copies out are exactly the trainer's."""
    rows, cols = 512, 256  # per rank: 512 x 128 bf16 = 128 KiB, two chunks of 64 KiB
    full = {"w": torch.randn(rows, cols).to(torch.bfloat16)}
    ranks = [connect(), connect()]
    reader = connect()

    def publish(version: int, weights: dict[str, torch.Tensor]) -> None:
        for r, c in enumerate(ranks):
            part = {"w": weights["w"][:, r * 128 : (r + 1) * 128].contiguous()}
            c.publish(
                "tp", version, part, shard=(r, 2), placements={"w": ((rows, cols), (0, r * 128))},
                chunk_size=CHUNK, delta=True,
            )  # fmt: skip

    def read(version: int) -> tuple[torch.Tensor, ros.SliceFetch]:
        out = torch.empty(rows, cols, dtype=torch.bfloat16)
        got = reader.fetch_slices(
            "tp", version, slices={"w": ros.Slice(out, (0, 0), (rows, cols))}, delta=True
        )
        return out, got

    publish(1, full)
    first, got = read(1)
    assert torch.equal(first.view(torch.int16), full["w"].view(torch.int16))
    assert got.deltas == {}
    full = step(full, 2)
    publish(2, full)
    second, got = read(2)
    assert torch.equal(second.view(torch.int16), full["w"].view(torch.int16))
    assert set(got.deltas) == {0, 1}
    assert all(d.chunks > 0 and d.base == 1 for d in got.deltas.values()), got.deltas
    assert reader.delta_memory()["staged"] == 2 * rows * 128 * 2  # a copy of each shard
    reader.drop_bases()
    assert reader.delta_memory()["staged"] == 0
    third, got = read(2)  # no base kept any more: read whole
    assert got.deltas == {}
    assert torch.equal(third.view(torch.int16), full["w"].view(torch.int16))
    assert reader.delta_memory()["staged"] > 0  # kept again, for the next one
    for c in (*ranks, reader):  # close() frees every copy
        c.close()
        assert c.delta_memory() == {"base_copies": 0, "staged": 0, "held_deltas": 0}


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
@pytest.mark.timeout(90)
def test_a_dead_or_frozen_delta_holder_fails_over_to_another_delta_holder(
    fault: str,
    hub_server: HubServer,
    make_tenant: Callable[[str], str],
) -> None:
    """Two readers hold the delta, one a process that is killed or frozen: the next reader
    still applies the delta, from the other (or reads whole what it cannot), exactly."""
    token = make_tenant("team-a")
    clients = [ros.connect(hub_server.address, tenant="team-a", token=token) for _ in range(3)]
    trainer, other, reader = clients
    try:
        w = model(9)
        trainer.publish("policy", 1, w, chunk_size=CHUNK, delta=True)
        seen = {c: c.fetch("policy", 1) for c in (other, reader)}
        for held in seen.values():
            held.release()
        w = step(w, 2)
        pub = trainer.publish("policy", 2, w, chunk_size=CHUNK, delta=True)
        with delta_holder(hub_server, token) as proc:
            applied = other.fetch("policy", 2, into=seen[other].tensors)
            assert applied.companion is not None
            assert pub.companion is not None
            pub.companion.release(force=True)  # the delta's holders: the process and `other`
            proc.send_signal(getattr(signal, fault))
            again = reader.fetch("policy", 2, into=seen[reader].tensors, timeout=30)
        assert same(again.tensors, w)
        assert again.delta is not None
        assert again.delta.chunks > 0, again.delta
    finally:
        for c in clients:
            c.close()


def test_a_double_buffered_reader_reuses_the_delta_it_already_holds(
    connect: Callable[..., ros.Hub],
) -> None:
    """Buffer A holds 1; 2 is applied into a copy B (the reader then holds the delta 1->2);
    3 into A with base=1 follows the chain 1->2->3 and uses the delta it holds for 1->2
    instead of asking to hold it twice (found by the chaos workload: it read whole)."""
    trainer, reader = connect(), connect()
    w = model(11)
    trainer.publish("policy", 1, w, chunk_size=CHUNK, delta=True)
    a = reader.fetch("policy", 1)
    w2 = step(w, 2)
    w3 = step(w2, 3)
    trainer.publish("policy", 2, w2, chunk_size=CHUNK, delta=True)
    trainer.publish("policy", 3, w3, chunk_size=CHUNK, delta=True)
    b = reader.fetch("policy", 2, into={k: t.clone() for k, t in a.tensors.items()}, base=1)
    assert b.delta is not None
    assert b.delta.chunks > 0
    a.release()
    again = reader.fetch("policy", 3, into=a.tensors, base=1)
    assert same(again.tensors, w3)
    assert again.delta is not None
    assert again.delta.links == 2, again.delta
    assert again.delta.chunks > 0, again.delta
