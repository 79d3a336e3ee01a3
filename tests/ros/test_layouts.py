"""Readers in another layout hold their blocks and serve each other (docs/design-notes.md,
"Readers in another layout"): through the SDK, against a real hub, etcd and holder
processes; every reader ends on the publisher's bytes."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

import pytest
import torch

import consistency.layouts as layouts_module
import ros
from chaos.holder_faults import Fault
from ros.client.hooks import ClientHooks
from ros.client.layouts import block_set
from ros.client.pins import Pins
from ros.hub.server import HubServer
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tests.ros.layout_model import CHUNK, block_bytes, expected, publish_tp, slices_for
from transport.wire import ChunkHeader


def _same(got: dict[str, torch.Tensor], rank: int, ranks: int) -> None:
    for name, want in expected(rank, ranks).items():
        assert torch.equal(got[name], want), name


def test_second_reader_of_a_layout_reads_every_byte_from_the_first(
    connect: Callable[..., ros.Hub],
) -> None:
    trainers = publish_tp(connect, 2)
    first, second = connect(), connect()
    out1, slices1 = slices_for(0, 2)
    got1 = first.fetch_slices("policy", 1, slices=slices1, layout="tp2", timeout=30)
    _same(out1, 0, 2)
    assert got1.served
    assert set(got1.bytes_per_source) <= {t.holder_name for t in trainers}
    assert got1.from_trainer == set(slices1)
    out2, slices2 = slices_for(0, 2)
    got2 = second.fetch_slices("policy", 1, slices=slices2, layout="tp2", timeout=30)
    _same(out2, 0, 2)
    assert got2.bytes_per_source == {first.holder_name: block_bytes(0, 2)}
    assert got2.from_trainer == set()
    assert got2.served


def test_progress_is_called_from_one_pipeline_at_a_time(connect: Callable[..., ros.Hub]) -> None:
    """The first reader reads both source shards at once, in threads; the caller's callback,
    written as for `fetch`, is never entered by two of them together."""
    publish_tp(connect, 2)
    inside, overlaps, calls = [0], [0], [0]

    def progress(_: object) -> None:
        inside[0] += 1
        overlaps[0] += inside[0] > 1
        calls[0] += 1
        time.sleep(0.002)  # long enough for another pipeline's chunk to arrive meanwhile
        inside[0] -= 1

    out, slices = slices_for(0, 1)
    got = connect().fetch_slices(
        "policy", 1, slices=slices, layout="tp1", timeout=30, progress=progress
    )
    _same(out, 0, 1)
    assert len(got.bytes_per_source) == 2  # both source shards were read
    assert calls[0] > 2
    assert overlaps[0] == 0


# -- holders in processes of their own -------------------------------------------------------

PROC = Path(__file__).with_name("layout_holder_proc.py")


class Holder:
    """A reader in a layout in a process of its own (tests/ros/layout_holder_proc.py)."""

    def __init__(self, hub: HubServer, token: str, *args: str, wait: bool = True) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(PROC), hub.address, TENANT, token, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.report: dict[str, Any] = {}
        self.name = ""
        if not wait:  # it is still reading: the test names it from the hub's record
            return
        line = self.line()
        while line == "sent":  # not before its own read: it reads, then serves
            line = self.line()
        self.report = json.loads(line)
        self.name = str(self.report["name"])

    def line(self) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        assert ready, "the holder process said nothing for 30 s"
        line = self.proc.stdout.readline().strip()
        assert line, f"the holder process ended (rc {self.proc.poll()})"
        return line

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


TENANT = "rl"


@pytest.fixture
def token(make_tenant: Callable[[str], str]) -> str:
    return make_tenant(TENANT)


@pytest.fixture
def clients(hub_server: HubServer, token: str) -> Iterator[Callable[..., ros.Hub]]:
    opened: list[ros.Hub] = []

    def open_client(**kwargs: object) -> ros.Hub:
        client = ros.connect(hub_server.address, tenant=TENANT, token=token, **kwargs)  # type: ignore[arg-type]
        opened.append(client)
        return client

    yield open_client
    for client in opened:
        client.close()


@pytest.fixture
def holders(hub_server: HubServer, token: str) -> Iterator[Callable[..., Holder]]:
    started: list[Holder] = []

    def start(*args: str, wait: bool = True) -> Holder:
        holder = Holder(hub_server, token, *args, wait=wait)
        started.append(holder)
        return holder

    yield start
    for holder in started:
        holder.stop()


def _trainer_bytes(got: ros.SliceFetch, trainers: list[ros.Hub]) -> int:
    names = {t.holder_name for t in trainers}
    return sum(n for source, n in got.bytes_per_source.items() if source in names)


@pytest.mark.slow  # holder processes of their own
def test_a_holder_killed_mid_read_leaves_only_its_missing_blocks_to_the_trainer(
    clients: Callable[..., ros.Hub], holders: Callable[..., Holder]
) -> None:
    trainers = publish_tp(clients, 2)
    slow = holders("--chunk-delay", "0.05")
    assert slow.report["served"]
    reader = clients()
    out, slices = slices_for(0, 2)
    with ThreadPoolExecutor(1) as pool:
        fetching = pool.submit(
            reader.fetch_slices, "policy", 1, slices=slices, layout="tp2", timeout=30
        )
        for _ in range(8):  # a few chunks sent, then the holder dies mid-read
            assert slow.line() == "sent"
        slow.proc.kill()
        got = fetching.result(timeout=60)
    _same(out, 0, 2)
    from_peer = got.bytes_per_source.get(slow.name, 0)
    assert from_peer >= 4 * 4096  # what it sent before it died was kept
    assert slow.name in got.failed_sources
    assert got.from_trainer
    assert got.from_trainer != set(slices)
    assert 0 < _trainer_bytes(got, trainers) < block_bytes(0, 2)
    assert got.served


@pytest.mark.slow  # holder processes of their own
def test_a_holder_serving_corrupt_bytes_is_dropped_and_its_blocks_read_elsewhere(
    clients: Callable[..., ros.Hub], holders: Callable[..., Holder]
) -> None:
    publish_tp(clients, 2)
    bad = holders("--corrupt")
    assert bad.report["served"]  # its own bytes are right; what it sends is not
    good = holders()
    assert bad.name in good.report["failed"]  # a holder process caught it too
    assert bad.name not in good.report["bytes"]
    assert good.report["served"]
    reader = clients()
    out, slices = slices_for(0, 2)
    got = reader.fetch_slices("policy", 1, slices=slices, layout="tp2", timeout=30)
    _same(out, 0, 2)  # the publisher's bytes, whoever sent them
    assert bad.name in got.failed_sources
    assert "Integrity" in got.failed_sources[bad.name]
    assert got.bytes_per_source.get(bad.name, 0) == 0  # no byte of it was kept
    assert got.served


@pytest.mark.slow  # holder processes of their own
def test_a_layout_holder_whose_lease_expires_is_no_longer_offered(
    clients: Callable[..., ros.Hub], holders: Callable[..., Holder]
) -> None:
    trainers = publish_tp(clients, 2)
    frozen = holders("--ttl", "2")
    assert frozen.report["served"]
    os.kill(frozen.proc.pid, signal.SIGSTOP)  # no more keepalives: its lease expires
    try:
        reader = clients()
        blocks = block_set(slices_for(0, 2)[1], CHUNK)
        request = pb.ResolveLayoutRequest(
            model="policy", version=1, layout="tp2", block_set=blocks.id
        )
        deadline = time.monotonic() + 15
        while reader._rpc("ResolveLayout", request).holders:
            assert time.monotonic() < deadline, "the frozen holder is still offered"
            time.sleep(0.2)
        out, slices = slices_for(0, 2)
        got = reader.fetch_slices("policy", 1, slices=slices, layout="tp2", timeout=30)
        _same(out, 0, 2)
        assert _trainer_bytes(got, trainers) == got.total_bytes  # nobody else to read from
        assert got.from_trainer == set(slices)
        assert got.served  # and the checksums its first reader recorded still check it
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)


def _offered(reader: ros.Hub, layout: str, rank: int, ranks: int, version: int = 1) -> int:
    """How many holders the hub offers for a TP-`ranks` worker's blocks in `layout`."""
    blocks = block_set(slices_for(rank, ranks)[1], CHUNK)
    request = pb.ResolveLayoutRequest(
        model="policy", version=version, layout=layout, block_set=blocks.id
    )
    return len(reader._rpc("ResolveLayout", request).holders)


def test_a_layout_first_seen_after_the_publish_is_read_from_the_trainer_then_from_peers(
    clients: Callable[..., ros.Hub],
) -> None:
    trainers = publish_tp(clients, 2)
    tp2 = clients()
    tp2.fetch_slices("policy", 1, slices=slices_for(1, 2)[1], layout="tp2", timeout=30)
    # elastic rollouts: TP 4 appears after policy@1 was published and read in TP 2
    first, second = clients(), clients()
    out1, slices1 = slices_for(3, 4)
    got1 = first.fetch_slices("policy", 1, slices=slices1, layout="tp4", timeout=30)
    _same(out1, 3, 4)
    assert _trainer_bytes(got1, trainers) == got1.total_bytes  # verified with the publisher's
    assert got1.from_trainer == set(slices1)
    assert got1.served
    out2, slices2 = slices_for(3, 4)
    got2 = second.fetch_slices("policy", 1, slices=slices2, layout="tp4", timeout=30)
    _same(out2, 3, 4)
    assert got2.bytes_per_source == {first.holder_name: block_bytes(3, 4)}
    assert _offered(second, "tp4", 3, 4) == 2
    assert _offered(second, "tp4", 0, 4) == 0


def test_released_blocks_are_no_longer_offered_and_go_with_their_version(
    clients: Callable[..., ros.Hub], hub_server: HubServer
) -> None:
    trainer = clients()
    weights = expected(0, 1)  # the whole model, published whole (no shards)
    trainer.publish("policy", 1, {k: v.contiguous() for k, v in weights.items()}, chunk_size=CHUNK)
    first, second = clients(), clients()
    first.fetch_slices("policy", 1, slices=slices_for(0, 2)[1], layout="tp2", timeout=30)
    second.fetch_slices("policy", 1, slices=slices_for(1, 2)[1], layout="tp2", timeout=30)
    assert _offered(trainer, "tp2", 0, 2) == 1
    assert first.release_blocks("policy", 1)
    assert not first.release_blocks("policy", 1)  # nothing left to release
    assert _offered(trainer, "tp2", 0, 2) == 0
    assert _offered(trainer, "tp2", 1, 2) == 1
    prefix = hub_server.keys.version_layouts(TENANT, "policy", 1)
    assert hub_server.etcd.count(prefix) > 0
    for version in (2, 3):  # the hub retains the newest 2: policy@1 is retired
        trainer.publish("policy", version, {k: v.clone() for k, v in weights.items()})
    deadline = time.monotonic() + 15
    while hub_server.etcd.count(prefix):
        assert time.monotonic() < deadline, "policy@1's layout keys outlived it"
        time.sleep(0.2)
    with pytest.raises(ros.VersionNotFound):
        _offered(trainer, "tp2", 1, 2)


def test_memory_that_serves_blocks_is_not_overwritten_until_they_are_released(
    clients: Callable[..., ros.Hub],
) -> None:
    publish_tp(clients, 2)
    reader = clients()
    out, slices = slices_for(0, 2)
    reader.fetch_slices("policy", 1, slices=slices, layout="tp2", timeout=30)
    with pytest.raises(ros.InvalidArgument, match="still serves policy@1"):
        reader.fetch_slices("policy", 1, slices=slices, layout="tp2", timeout=30)
    with pytest.raises(ros.AlreadyExists, match="already holds policy@1"):
        reader.fetch_slices("policy", 1, slices=slices_for(1, 2)[1], layout="tp2", timeout=30)
    assert reader.release_blocks("policy", 1)
    got = reader.fetch_slices("policy", 1, slices=slices, layout="tp2", timeout=30)
    _same(out, 0, 2)
    assert got.served


def test_a_layout_needs_contiguous_unshared_memory(clients: Callable[..., ros.Hub]) -> None:
    publish_tp(clients, 2)
    reader = clients()
    _out, slices = slices_for(0, 2)
    wide = torch.empty(64, 128)  # qkv's block taken from a wider buffer: not contiguous
    slices["l0.qkv.weight"] = ros.Slice(wide[:, :64], (0, 0), (128, 64))
    with pytest.raises(ros.InvalidArgument, match="contiguous"):
        reader.fetch_slices("policy", 1, slices=slices, layout="tp2", timeout=30)
    with pytest.raises(ros.InvalidArgument, match="layout"):
        reader.fetch_slices("policy", 1, slices=slices_for(0, 2)[1], layout="no/such", timeout=30)


def test_a_tp1_reader_is_covered_by_tp2_holders(clients: Callable[..., ros.Hub]) -> None:
    trainers = publish_tp(clients, 2)
    tp2 = [clients(), clients()]
    for rank, worker in enumerate(tp2):
        got = worker.fetch_slices("policy", 1, slices=slices_for(rank, 2)[1], layout="tp2")
        assert got.served
    whole = clients()
    out, slices = slices_for(0, 1)
    got = whole.fetch_slices("policy", 1, slices=slices, layout="tp1", cover=("tp2",), timeout=30)
    _same(out, 0, 1)
    assert got.from_trainer == set()
    assert _trainer_bytes(got, trainers) == 0
    names = {w.holder_name for w in tp2}
    assert set(got.bytes_per_source) <= names
    assert len(got.bytes_per_source) == 2  # every split tensor takes a block of each
    assert got.served
    # and the next TP-1 reader reads from the first one, its own layout's holder
    again_out, again = slices_for(0, 1)
    second = clients().fetch_slices("policy", 1, slices=again, layout="tp1", cover=("tp2",))
    _same(again_out, 0, 1)
    assert second.bytes_per_source == {whole.holder_name: block_bytes(0, 1)}


def test_a_cover_names_complete_holders_past_more_partial_ones_than_it_lists(
    clients: Callable[..., ros.Hub],
) -> None:
    """Each TP-2 block set has more PARTIAL holders (readers still reading) than a cover
    lists, all sorting before its COMPLETE holder in key order (their names): the TP-1 reader
    is still told of the COMPLETE ones and reads every byte from them, none from the trainer.
    (The PARTIAL ones register after the COMPLETE ones read: a PARTIAL holder registered
    before would be a TP-2 reader's predecessor, and these serve nothing.)"""
    trainers = publish_tp(clients, 2)
    tp2 = [clients(name=f"z{rank}") for rank in range(2)]
    for rank, worker in enumerate(tp2):
        worker.fetch_slices("policy", 1, slices=slices_for(rank, 2)[1], layout="tp2", timeout=30)
    for i in range(layouts_module.COVER_HOLDERS_EACH + 1):
        reading = clients(name=f"a{i}")
        reading._layouts.serving.start()  # a record names the endpoints it serves on
        for rank in range(2):
            blocks = block_set(slices_for(rank, 2)[1], CHUNK)
            reading._rpc(
                "RegisterLayoutHolder",
                pb.RegisterLayoutHolderRequest(
                    model="policy", version=1, layout="tp2", block_set=blocks.id,
                    holder=reading._layouts.records.record(False), blocks=blocks.description,
                ),
            )  # fmt: skip
    assert _offered(clients(), "tp2", 0, 2) == layouts_module.COVER_HOLDERS_EACH + 2
    whole = clients()
    out, slices = slices_for(0, 1)
    got = whole.fetch_slices("policy", 1, slices=slices, layout="tp1", cover=("tp2",), timeout=30)
    _same(out, 0, 1)
    assert got.from_trainer == set()
    assert _trainer_bytes(got, trainers) == 0
    assert set(got.bytes_per_source) == {"z0", "z1"}
    assert got.failed_sources == {}


def test_blocks_a_cover_lacks_are_read_from_the_trainer(clients: Callable[..., ros.Hub]) -> None:
    trainers = publish_tp(clients, 2)
    half = clients()  # only TP-2 rank 1's blocks are held: rank 0's halves are missing
    half.fetch_slices("policy", 1, slices=slices_for(1, 2)[1], layout="tp2", timeout=30)
    whole = clients()
    out, slices = slices_for(0, 1)
    got = whole.fetch_slices("policy", 1, slices=slices, layout="tp1", cover=("tp2",), timeout=30)
    _same(out, 0, 1)
    split = {name for name in slices if name.endswith("weight") and name != "norm.weight"}
    assert got.from_trainer == split  # the replicated ones came whole from the one holder
    assert got.bytes_per_source[half.holder_name] > 0
    assert _trainer_bytes(got, trainers) > 0
    with pytest.raises(ros.InvalidArgument, match="cover"):
        whole.fetch_slices("policy", 1, slices=slices_for(0, 1)[1], cover=("tp2",))


def test_a_corrupt_holder_of_a_cover_costs_only_its_blocks(clients: Callable[..., ros.Hub]) -> None:
    trainers = publish_tp(clients, 2)
    bad = clients(hooks=ClientHooks(send=Fault(corrupt=True)))
    bad.fetch_slices("policy", 1, slices=slices_for(0, 2)[1], layout="tp2", timeout=30)
    good = clients()
    good.fetch_slices("policy", 1, slices=slices_for(1, 2)[1], layout="tp2", timeout=30)
    whole = clients()
    out, slices = slices_for(0, 1)
    got = whole.fetch_slices("policy", 1, slices=slices, layout="tp1", cover=("tp2",), timeout=30)
    _same(out, 0, 1)  # the publisher's bytes
    assert bad.holder_name in got.failed_sources
    assert got.bytes_per_source.get(bad.holder_name, 0) == 0
    assert got.bytes_per_source[good.holder_name] > 0
    split = {name for name in slices if name.endswith(("qkv.weight", "o.weight"))}
    assert got.from_trainer <= split  # what only the corrupt holder had
    assert got.from_trainer
    assert _trainer_bytes(got, trainers) > 0
    assert got.served


def test_a_session_recovery_registers_the_blocks_again(
    clients: Callable[..., ros.Hub], hub_server: HubServer
) -> None:
    publish_tp(clients, 2)
    reader = clients(session_ttl=2)
    reader.fetch_slices("policy", 1, slices=slices_for(0, 2)[1], layout="tp2", timeout=30)
    other = clients()
    assert _offered(other, "tp2", 0, 2) == 1
    lost = reader.session.id
    hub_server.etcd.lease_revoke(lost)  # its records go with the lease
    deadline = time.monotonic() + 15
    while reader.session.id == lost or not _offered(other, "tp2", 0, 2):
        assert time.monotonic() < deadline, "the blocks were never registered again"
        time.sleep(0.1)
    out, slices = slices_for(0, 2)
    got = other.fetch_slices("policy", 1, slices=slices, layout="tp2", timeout=30)
    _same(out, 0, 2)
    assert got.bytes_per_source == {reader.holder_name: block_bytes(0, 2)}


def test_slices_that_overlap_in_memory_are_refused(clients: Callable[..., ros.Hub]) -> None:
    publish_tp(clients, 2)
    _, slices = slices_for(0, 2)
    buffer = torch.empty(64 * 64 + 1)  # two blocks' memory overlapping by one element
    slices["l0.qkv.weight"] = ros.Slice(buffer[: 64 * 64].view(64, 64), (0, 0), (128, 64))
    slices["norm.weight"] = ros.Slice(buffer[64 * 64 - 63 :], (0,), (64,))
    with pytest.raises(ros.InvalidArgument, match="share memory"):
        clients().fetch_slices("policy", 1, slices=slices, layout="tp2", timeout=30)


def test_a_reader_past_the_layouts_bound_keeps_its_bytes_and_serves_none(
    clients: Callable[..., ros.Hub], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(layouts_module, "MAX_BLOCK_SETS_PER_LAYOUT", 1)  # the hub's, here
    publish_tp(clients, 2)
    first = clients().fetch_slices("policy", 1, slices=slices_for(0, 2)[1], layout="tp2")
    assert first.served
    out, slices = slices_for(1, 2)
    got = clients().fetch_slices("policy", 1, slices=slices, layout="tp2", timeout=30)
    _same(out, 1, 2)
    assert not got.served
    assert _offered(clients(), "tp2", 1, 2) == 0


# -- readers that start together: pipelined --------------------------------------------------


@dataclass
class Gate(Fault):
    """A trainer's sender that sends its first `first` chunks, then none until `opened`
    (at most 20 s): so a test knows the first reader is still reading."""

    first: int = 0
    opened: threading.Event = field(default_factory=threading.Event)
    _sent: Iterator[int] = field(default_factory=count)

    def __call__(
        self, conn: socket.socket, header: ChunkHeader, views: list[memoryview], complete: bool
    ) -> None:
        if next(self._sent) >= self.first:
            self.opened.wait(20)
        super().__call__(conn, header, views, complete)


def _gated(clients: Callable[..., ros.Hub], first: int = 0) -> tuple[list[ros.Hub], Gate]:
    gate = Gate(first=first)
    return publish_tp(lambda: clients(hooks=ClientHooks(send=gate)), 2), gate


def _holders_of(reader: ros.Hub, at_least: int) -> list[pb.Holder]:
    """The holders of TP-2 rank 0's blocks, once at least `at_least` are registered."""
    blocks = block_set(slices_for(0, 2)[1], CHUNK)
    request = pb.ResolveLayoutRequest(model="policy", version=1, layout="tp2", block_set=blocks.id)
    # a holder is a subprocess that imports torch and reads before it registers: on 2 cores
    # beside other work that took over 15 s once, so the wait allows 60
    deadline = time.monotonic() + 60
    while len(found := list(reader._rpc("ResolveLayout", request).holders)) < at_least:
        assert time.monotonic() < deadline, f"{len(found)} holders registered, not {at_least}"
        time.sleep(0.05)
    return sorted(found, key=lambda h: h.fence)


def test_readers_that_start_together_read_from_each_other_while_the_first_reads(
    clients: Callable[..., ros.Hub],
) -> None:
    trainers, gate = _gated(clients)
    watcher = clients()
    readers = [clients() for _ in range(3)]
    outs, slices = zip(*(slices_for(0, 2) for _ in readers), strict=True)
    with ThreadPoolExecutor(3) as pool:
        fetches = []
        for n, (reader, wanted) in enumerate(zip(readers, slices, strict=True)):
            fetches.append(
                pool.submit(reader.fetch_slices, "policy", 1, slices=wanted, layout="tp2")
            )
            held = _holders_of(watcher, n + 1)  # each registers PARTIAL before it reads
        assert [h.state for h in held] == [pb.PARTIAL] * 3
        assert not any(f.done() for f in fetches)  # the trainer has sent nothing yet
        gate.opened.set()
        got = [f.result(timeout=60) for f in fetches]
    for out in outs:
        _same(out, 0, 2)
    first, second, third = got
    assert first.from_trainer == set(slices[0])
    assert _trainer_bytes(first, trainers) == first.total_bytes
    # a chain, as for whole versions: each later reader reads every byte from the one
    # registered just before it, as that one reads them
    assert second.bytes_per_source == {readers[0].holder_name: block_bytes(0, 2)}
    assert third.bytes_per_source == {readers[1].holder_name: block_bytes(0, 2)}
    assert second.from_trainer == third.from_trainer == set()
    assert all(g.served for g in got)
    assert [h.state for h in _holders_of(watcher, 3)] == [pb.COMPLETE] * 3


@dataclass
class Sent(Gate):
    """A `Gate` that records the index of every chunk it let through, once sent."""

    indices: list[int] = field(default_factory=list)

    def __call__(
        self, conn: socket.socket, header: ChunkHeader, views: list[memoryview], complete: bool
    ) -> None:
        super().__call__(conn, header, views, complete)
        self.indices.append(header.index)


def test_a_chained_reader_gets_a_chunk_before_the_first_reader_has_its_whole_block(
    clients: Callable[..., ros.Hub],
) -> None:
    """The first reader serves each chunk of its block set as soon as that chunk's own bytes
    are verified and in place (`ros.client.slice_fill`), not once every block it touches is
    complete: with the trainer stopped after one of the four chunks of block l0.qkv, the
    reader chained behind it already holds that chunk, and the block's other chunks are
    missing everywhere."""
    gate = Sent(first=3)  # l0.o's two chunks (the first step), then one of l0.qkv's
    trainers = publish_tp(lambda: clients(hooks=ClientHooks(send=gate)), 2)
    watcher = clients()
    seen: list[Any] = []  # the chained reader's block set, as it reads it

    def capture(read: Callable[..., Any]) -> Callable[..., Any]:
        def reading(*args: Any, **kwargs: Any) -> Any:
            seen.append(args[4])  # read_round(tenant, model, version, layout, dest, ...)
            return read(*args, **kwargs)

        return reading

    first, chained = clients(), clients(hooks=ClientHooks(read=capture))
    outs, slices = zip(*(slices_for(0, 2) for _ in range(2)), strict=True)
    blocks = block_set(slices[0], CHUNK)
    spec = next(t for t in blocks.layout.tensors if t.name == "l0.qkv.weight")
    assert spec.offset % CHUNK == 0  # whole chunks of that block only
    ours = range(spec.offset // CHUNK, (spec.offset + spec.nbytes) // CHUNK)
    assert len(ours) == 4
    with ThreadPoolExecutor(2) as pool:
        fetches = [pool.submit(first.fetch_slices, "policy", 1, slices=slices[0], layout="tp2")]
        _holders_of(watcher, 1)
        fetches.append(
            pool.submit(chained.fetch_slices, "policy", 1, slices=slices[1], layout="tp2")
        )
        deadline = time.monotonic() + 20
        while not (seen and any(seen[0].is_present(i) for i in ours)):
            assert time.monotonic() < deadline, "no chunk of l0.qkv reached the chained reader"
            time.sleep(0.02)
        held = [i for i in ours if seen[0].is_present(i)]
        assert len(gate.indices) == 3  # the trainer is stopped: l0.qkv is not whole anywhere
        assert len(held) == 1
        assert not any(f.done() for f in fetches)
        gate.opened.set()
        got = [f.result(timeout=60) for f in fetches]
    for out in outs:
        _same(out, 0, 2)
    assert got[0].from_trainer == set(slices[0])
    assert _trainer_bytes(got[0], trainers) == got[0].total_bytes
    assert got[1].bytes_per_source == {first.holder_name: block_bytes(0, 2)}
    assert all(g.served for g in got)


@pytest.mark.slow  # a holder process of its own
def test_a_partial_holder_killed_mid_read_leaves_only_its_missing_blocks_to_the_trainer(
    clients: Callable[..., ros.Hub], holders: Callable[..., Holder]
) -> None:
    trainers, gate = _gated(clients, first=12)  # then the holder's own read waits
    watcher = clients()
    slow = holders("--chunk-delay", "0.05", wait=False)
    (record,) = _holders_of(watcher, 1)
    slow.name = record.name
    reader = clients()
    out, slices = slices_for(0, 2)
    with ThreadPoolExecutor(1) as pool:
        fetching = pool.submit(
            reader.fetch_slices, "policy", 1, slices=slices, layout="tp2", timeout=30
        )
        _holders_of(watcher, 2)
        for _ in range(3):  # a few chunks sent, then the holder dies mid-read (its own)
            assert slow.line() == "sent"
        assert _holders_of(watcher, 2)[0].state == pb.PARTIAL
        slow.proc.kill()
        gate.opened.set()
        got = fetching.result(timeout=60)
    _same(out, 0, 2)
    assert 0 < got.bytes_per_source.get(slow.name, 0) < block_bytes(0, 2)  # kept
    assert slow.name in got.failed_sources
    assert got.from_trainer
    assert got.from_trainer != set(slices)
    assert 0 < _trainer_bytes(got, trainers) < block_bytes(0, 2)
    assert got.served


@pytest.mark.slow  # a holder process of its own
def test_a_partial_holder_serving_corrupt_bytes_is_caught_by_its_chunks_checksums(
    clients: Callable[..., ros.Hub], holders: Callable[..., Holder]
) -> None:
    trainers, gate = _gated(clients)
    watcher = clients()
    holders("--corrupt", wait=False)  # its bytes are right; what it sends is not
    (record,) = _holders_of(watcher, 1)
    reader = clients()
    out, slices = slices_for(0, 2)
    with ThreadPoolExecutor(1) as pool:
        fetching = pool.submit(
            reader.fetch_slices, "policy", 1, slices=slices, layout="tp2", timeout=30
        )
        _holders_of(watcher, 2)  # no checksums recorded yet: those in its CHUNK frames
        gate.opened.set()
        got = fetching.result(timeout=60)
    _same(out, 0, 2)  # the publisher's bytes, whoever sent them
    assert record.name in got.failed_sources
    assert "Integrity" in got.failed_sources[record.name]
    assert got.bytes_per_source.get(record.name, 0) == 0  # no byte of it was kept
    assert got.from_trainer == set(slices)
    assert _trainer_bytes(got, trainers) == got.total_bytes
    assert got.served


def test_a_partial_holder_records_no_checksums_and_covers_no_one(
    clients: Callable[..., ros.Hub],
) -> None:
    publish_tp(clients, 2)
    first = clients()
    first.fetch_slices("policy", 1, slices=slices_for(0, 2)[1], layout="tp2", timeout=30)
    other = clients()
    other._layouts.serving.start()  # a record names the endpoints it serves on
    blocks = block_set(slices_for(0, 2)[1], CHUNK)

    def partial(sums: list[int]) -> pb.RegisterLayoutHolderRequest:
        return pb.RegisterLayoutHolderRequest(
            model="policy", version=1, layout="tp2", block_set=blocks.id,
            holder=other._layouts.records.record(False), block_sums=sums,
            blocks=blocks.description,
        )  # fmt: skip

    with pytest.raises(ros.InvalidArgument, match="PARTIAL"):
        other._rpc("RegisterLayoutHolder", partial([1] * blocks.layout.num_chunks))
    other._rpc("RegisterLayoutHolder", partial([]))
    assert _offered(clients(), "tp2", 0, 2) == 2
    request = pb.ResolveLayoutCoverRequest(model="policy", version=1, layout="tp2")
    (covering,) = clients()._rpc("ResolveLayoutCover", request).block_sets
    assert [h.name for h in covering.holders] == [first.holder_name]  # COMPLETE ones only


def test_a_partial_registration_answers_what_resolve_layout_would(
    clients: Callable[..., ros.Hub],
) -> None:
    """A PARTIAL registration's answer is ResolveLayout's at the registration's revision,
    from the registrant's topology: the holders registered before it, nearest first (never
    itself, never one registered after it: no cycle), and the recorded checksums."""
    publish_tp(clients, 2)
    blocks = block_set(slices_for(0, 2)[1], CHUNK)
    hosts = {"a": "h1", "b": "h2", "c": "h2", "d": "h3"}
    hub = {name: clients(topology={"host": host}) for name, host in hosts.items()}

    def register(name: str, sums: list[int] | None = None) -> pb.RegisterLayoutHolderResponse:
        client = hub[name]
        client._layouts.serving.start()  # a record names the endpoints it serves on
        request = pb.RegisterLayoutHolderRequest(
            model="policy", version=1, layout="tp2", block_set=blocks.id,
            holder=client._layouts.records.record(sums is not None), block_sums=sums or [],
            blocks=blocks.description,
        )  # fmt: skip
        return client._rpc("RegisterLayoutHolder", request)

    def resolve(name: str) -> pb.ResolveLayoutResponse:
        request = pb.ResolveLayoutRequest(
            model="policy", version=1, layout="tp2", block_set=blocks.id,
            topology={"host": hosts[name]}, holder=hub[name].holder_name,
        )  # fmt: skip
        return hub[name]._rpc("ResolveLayout", request)

    def same(registered: pb.RegisterLayoutHolderResponse, name: str) -> list[str]:
        resolved = resolve(name)
        assert list(registered.holders) == list(resolved.holders)
        assert list(registered.block_sums) == list(resolved.block_sums)
        assert registered.total_holders == resolved.total_holders
        assert registered.revision <= resolved.revision
        return [h.name for h in registered.holders]

    a = register("a")
    assert same(a, "a") == []  # itself only: it reads the trainer's shards
    assert a.total_holders == 1
    b = register("b")
    assert same(b, "b") == [hub["a"].holder_name]
    c = register("c")  # b shares its host: nearest first, before the older a
    assert same(c, "c") == [hub["b"].holder_name, hub["a"].holder_name]
    assert all(h.fence < c.fence for h in c.holders)
    # b's answer was read at its own revision: c, registered after, is not in it, though
    # a ResolveLayout now offers c to b (the reader's fence then keeps it out)
    assert hub["c"].holder_name not in {h.name for h in b.holders}
    later = {h.name: h.fence for h in resolve("b").holders}
    assert later[hub["c"].holder_name] > b.fence
    # once a COMPLETE holder recorded checksums, a PARTIAL registration answers them
    recorded = [7] * blocks.layout.num_chunks
    assert list(register("a", recorded).block_sums) == recorded
    d = register("d")
    assert list(d.block_sums) == recorded
    assert same(d, "d")[0] == hub["a"].holder_name  # all elsewhere: the oldest first
    assert [h.state for h in d.holders] == [pb.COMPLETE, pb.PARTIAL, pb.PARTIAL]


def test_a_reader_reads_from_the_holders_its_registration_answered(
    clients: Callable[..., ros.Hub],
) -> None:
    """The registration's answer is the first round's: a reader whose holders give every
    block asks no ResolveLayout, and its registration pins the version, so it calls no
    Pin or Unpin either (three hub calls fewer than a Resolve, Pin, RegisterLayoutHolder,
    ResolveLayout, RegisterLayoutHolder and Unpin)."""
    trainers = publish_tp(clients, 2)
    first = clients()
    first.fetch_slices("policy", 1, slices=slices_for(0, 2)[1], layout="tp2", timeout=30)
    second = clients()
    calls: list[str] = []
    rpc = second._layouts.rpc

    def counting(method: str, request: Any, timeout: float | None = None) -> Any:
        calls.append(method)
        return rpc(method, request, timeout)  # type: ignore[call-overload]

    second._layouts = dataclasses.replace(second._layouts, rpc=counting)
    second._pins = Pins(counting, second.session)  # type: ignore[arg-type]
    out, slices = slices_for(0, 2)
    got = second.fetch_slices("policy", 1, slices=slices, layout="tp2", timeout=30)
    _same(out, 0, 2)
    assert got.bytes_per_source == {first.holder_name: block_bytes(0, 2)}
    assert not set(got.bytes_per_source) & {t.holder_name for t in trainers}
    assert calls == ["RegisterLayoutHolder", "RegisterLayoutHolder"]  # PARTIAL, COMPLETE
