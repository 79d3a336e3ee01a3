"""A first reader in a layout asks for a step's trainer chunks before the step before it has
arrived (`ros.client.slice_ahead`), and a failure mid-pipeline takes back every request it
had out: through the SDK, against a real hub, etcd and trainer ranks that serve slowly."""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import pytest
import torch

import ros
from chaos.holder_faults import Fault
from ros.client.hooks import ClientHooks
from tensorhub.errors import IntegrityError
from tests.ros.layout_model import expected, publish_tp, slices_for
from transport.wire import ChunkHeader

TENANT = "rl"


@dataclass
class Recorder(Fault):
    """A trainer rank's sender that waits `chunk_delay` before each chunk, records each
    chunk it sent (its server's port, the reader's port of the connection, the chunk, when
    the server began it and when it was sent) and, from its `corrupt_after`-th chunk on,
    sends corrupt bytes."""

    sent: list[tuple[int, int, int, float, float]] = field(default_factory=list)
    corrupt_after: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(
        self, conn: socket.socket, header: ChunkHeader, views: list[memoryview], complete: bool
    ) -> None:
        began = time.monotonic()
        with self.lock:
            if self.corrupt_after is not None and len(self.sent) >= self.corrupt_after:
                self.corrupt = True
        super().__call__(conn, header, views, complete)
        with self.lock:
            at, peer = conn.getsockname()[1], conn.getpeername()[1]
            self.sent.append((at, peer, header.index, began, time.monotonic()))


@pytest.fixture
def clients(connect: Callable[..., ros.Hub]) -> Callable[..., ros.Hub]:
    """Clients of tenant `TENANT` (tests/ros/conftest.py's `connect`: closed at the end)."""
    return functools.partial(connect, TENANT)


def _trainers(clients: Callable[..., ros.Hub], senders: list[Recorder]) -> list[ros.Hub]:
    """TP-2 trainer ranks publishing policy@1, rank r serving through `senders[r]`."""
    ranks = iter(senders)
    return publish_tp(lambda: clients(hooks=ClientHooks(send=next(ranks))), 2)


def _overlaps(sent: list[tuple[int, int, int, float, float]]) -> int:
    """How many times a connection's first chunk was begun (its GET had arrived) before the
    last chunk of the connection begun before it was sent."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for _, peer, _, began, done in sent:
        first[peer] = min(first.get(peer, began), began)
        last[peer] = max(last.get(peer, done), done)
    conns = sorted(first, key=first.__getitem__)
    assert len(conns) > 2  # a round per step
    return sum(1 for a, b in pairwise(conns) if first[b] < last[a])


def test_the_next_step_asks_for_its_chunks_before_the_step_before_has_arrived(
    clients: Callable[..., ros.Hub],
) -> None:
    """Each step of a source shard is a round of its own (one connection, one GET). With
    trainer ranks that take 20 ms a chunk, a later step's GET reaches a rank (it begins
    that connection's first chunk) before the last chunk of the step before it has left:
    that step's request was out while the one before was still arriving. Each trainer
    chunk is still sent once (what two steps share is carried, not asked for twice), and
    the reader ends on the trainer's bytes."""
    senders = [Recorder(chunk_delay=0.02), Recorder(chunk_delay=0.02)]
    trainers = _trainers(clients, senders)
    out, slices = slices_for(0, 1)  # the whole model: both source shards, in steps
    got = clients().fetch_slices("policy", 1, slices=slices, layout="tp1", timeout=60)
    for name, want in expected(0, 1).items():
        assert torch.equal(out[name], want), name
    overlaps = 0
    for s in senders:
        assert len({sent[0] for sent in s.sent}) == 1  # one server per rank
        overlaps += _overlaps(s.sent)
        indices = [sent[2] for sent in s.sent]
        assert len(indices) == len(set(indices))  # no trainer chunk read twice
    assert overlaps > 0
    assert set(got.bytes_per_source) == {t.holder_name for t in trainers}
    assert got.from_trainer == set(slices)
    assert got.served


def _established_to(port: int) -> int:
    """This process's TCP connections in ESTABLISHED state whose remote port is `port`
    (the reader's side of a connection to a holder's data port)."""
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            remote, state = fields[2], fields[3]
            if state == "01" and int(remote.rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


def test_a_failure_mid_pipeline_takes_back_every_request_and_writes_no_unverified_byte(
    clients: Callable[..., ros.Hub],
) -> None:
    """Trainer rank 1 sends corrupt bytes from its fourth chunk on, while rank 0 serves
    slowly: the read fails with `IntegrityError` (rank 1 is its shard's only holder). When
    it returns, no connection of the reader to either rank is left open (the rounds still
    out, rank 0's included, were cut), rank 0 sends no more chunks, and every element of
    the blocks is either the trainer's or untouched: no byte of a chunk that failed its
    checksum was written into them."""
    senders = [Recorder(chunk_delay=0.1), Recorder(chunk_delay=0.02, corrupt_after=3)]
    _trainers(clients, senders)
    out, slices = slices_for(0, 1)
    for t in out.values():
        t.fill_(float("nan") if t.is_floating_point() else -1)
    reader = clients()
    with pytest.raises(IntegrityError):
        reader.fetch_slices("policy", 1, slices=slices, layout="tp1", timeout=60)
    ports = [s.sent[0][0] for s in senders]
    assert [_established_to(port) for port in ports] == [0, 0]
    left = [t.name for t in threading.enumerate() if t.name.startswith(("slices-", "fetch-"))]
    assert not left  # no step, pipeline or round worker of the read still runs
    with senders[0].lock:
        sent = len(senders[0].sent)
    time.sleep(1.0)  # ten of rank 0's chunk delays: a round still out would send on
    with senders[0].lock:  # at most the chunk each of its connections (two, a step
        assert len(senders[0].sent) <= sent + 2  # ahead) was sending when it was cut
    written = 0
    for name, want in expected(0, 1).items():
        got = out[name]
        untouched = got.isnan() if got.is_floating_point() else got == -1
        ok = untouched | (got == want)
        assert bool(ok.all()), name
        written += int((~untouched).sum())
    assert written > 0  # verified chunks of rank 0 (and of rank 1 before it went bad)
