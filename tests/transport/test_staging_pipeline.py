"""The double-buffered staging's bookkeeping, on the CPU (transport/pipeline.py, staging.py).

The real pipelines, `HeldVersion`, holder server and TCP channel run here; only the copy
engine is a stand-in. `LaterCopies` behaves like a CUDA copy stream: copies run in issue
order, only when an event is waited for (or queried, for a "fast device"), and until then
their destination holds poison bytes. It also fails the test if a copy is issued on a
host buffer that a copy still pending uses (a buffer reused before its event completed).
"""

from __future__ import annotations

import socket
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from tensorhub.errors import InvalidArgument
from tests.transport._model import MODEL, TENANT, make_model
from transport.copies import HostCopies, Pair
from transport.layout import Layout
from transport.outcome import ChunkOutcome, ChunkStatus
from transport.pipeline import GatherAhead, ScatterBehind
from transport.planner import Source
from transport.reader import fetch
from transport.receiving import FetchState
from transport.server import HolderServer, allow_all, send_chunk
from transport.staging import StagingBuffer
from transport.store import HeldVersion, HolderStore
from transport.topology import Topology
from transport.transports import TcpChannel
from transport.wire import ChunkHeader

POISON = 0xEE


class LaterEvent:
    """One batch of `LaterCopies`: done once run."""

    def __init__(self, copies: LaterCopies, pairs: Sequence[Pair]) -> None:
        self.copies, self.pairs, self.done = copies, list(pairs), False

    def query(self) -> bool:
        if self.copies.fast and not self.done:
            self.copies.run_until(self)
        return self.done

    def synchronize(self) -> None:
        self.copies.run_until(self)


class LaterCopies:
    """Copies that happen later, in order, like a copy stream's (see the module doc)."""

    def __init__(self, *, fast: bool = False) -> None:
        self.fast = fast  # a query runs the queue up to its event (a device that keeps up)
        self.queue: deque[LaterEvent] = deque()
        self.hosts: set[int] = set()  # storages handed out by host_buffer
        self.issued = 0  # copies issued (pairs)
        self.most = 0  # the most batches ever in flight at once
        self.fail = False  # the next event run raises, like a CUDA error

    def host_buffer(self, size: int) -> torch.Tensor:
        t = torch.full((size,), POISON, dtype=torch.uint8)
        self.hosts.add(t.untyped_storage().data_ptr())
        return t

    def _host_ranges(self, pairs: Sequence[Pair]) -> set[tuple[int, int, int]]:
        out = set()
        for dst, src in pairs:
            for t in (dst, src):
                base = t.untyped_storage().data_ptr()
                if base in self.hosts:
                    start = int(t.storage_offset())
                    out.add((base, start, start + t.numel()))
        return out

    def copy(self, pairs: Sequence[Pair]) -> LaterEvent:
        mine = {base for base, _, _ in self._host_ranges(pairs)}
        busy = {base for e in self.queue for base, _, _ in self._host_ranges(e.pairs)}
        assert not mine & busy, "a host buffer was reused while a copy on it was pending"
        for dst, _ in pairs:
            dst.fill_(POISON)  # in flight: undefined until the event completes
        event = LaterEvent(self, pairs)
        self.queue.append(event)
        self.issued += len(pairs)
        self.most = max(self.most, len(self.queue))
        return event

    def run_until(self, event: LaterEvent) -> None:
        while not event.done:
            head = self.queue.popleft()
            if self.fail:
                self.fail = False
                raise RuntimeError("copy failed (simulated device error)")
            for dst, src in head.pairs:
                dst.copy_(src)
            head.done = True


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 255, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def _parts(*tensors: torch.Tensor) -> Callable[[], list[torch.Tensor]]:
    return lambda: list(tensors)


# -- send side: GatherAhead ----------------------------------------------------------------


def test_gather_starts_the_next_copy_before_this_one_is_waited_for() -> None:
    copies = LaterCopies()
    g = GatherAhead(copies, 64)
    a, b, c = _bytes(40, 1), _bytes(64, 2), _bytes(10, 3)
    view = g.take("a", _parts(a[:25], a[25:]), then=("b", _parts(b)))
    assert bytes(view) == a.numpy().tobytes()
    assert copies.issued == 3
    assert len(copies.queue) == 1
    view = g.take("b", _parts(b), then=("c", _parts(c)))  # b was staged: not copied again
    assert bytes(view) == b.numpy().tobytes()
    assert copies.issued == 4
    assert len(copies.queue) == 1
    assert bytes(g.take("c", _parts(c))) == c.numpy().tobytes()
    assert copies.issued == 4


def test_gather_hands_out_the_current_chunk_again_without_copying() -> None:
    copies = LaterCopies()
    g = GatherAhead(copies, 64)
    a, b = _bytes(64, 1), _bytes(64, 2)
    first = bytes(g.take("a", _parts(a), then=("b", _parts(b))))
    assert bytes(g.take("a", _parts(a))) == first  # the checksum path: same staged bytes
    assert copies.issued == 2


def test_gather_a_buffer_is_reused_only_after_its_copy_completed() -> None:
    copies = LaterCopies()  # asserts on reuse of a busy buffer
    g = GatherAhead(copies, 64)
    chunks = {k: _bytes(64, i) for i, k in enumerate("abcdef")}
    g.take("a", _parts(chunks["a"]), then=("b", _parts(chunks["b"])))
    # the caller skipped b: c goes to a's buffer, d displaces the pending b (waited first)
    assert bytes(g.take("c", _parts(chunks["c"]), then=("d", _parts(chunks["d"])))) == bytes(
        chunks["c"].numpy()
    )
    assert bytes(g.take("d", _parts(chunks["d"]), then=("e", _parts(chunks["e"])))) == bytes(
        chunks["d"].numpy()
    )
    assert bytes(g.take("f", _parts(chunks["f"]))) == bytes(chunks["f"].numpy())


def test_gather_drain_waits_for_every_copy_and_forgets_the_chunks() -> None:
    copies = LaterCopies()
    g = GatherAhead(copies, 64)
    a, b = _bytes(64, 1), _bytes(64, 2)
    g.take("a", _parts(a), then=("b", _parts(b)))
    g.drain()
    assert not copies.queue  # no copy outlives the read
    b.fill_(7)  # the memory may change once the read ended
    assert bytes(g.take("b", _parts(b))) == bytes([7]) * 64  # copied again, not stale


def test_gather_a_failed_copy_raises_and_stages_nothing() -> None:
    copies = LaterCopies()
    g = GatherAhead(copies, 64)
    a = _bytes(64, 1)
    copies.fail = True
    with pytest.raises(RuntimeError, match="simulated"):
        g.take("a", _parts(a))
    assert bytes(g.take("a", _parts(a))) == bytes(a.numpy())  # copied again


def test_gather_refuses_a_chunk_larger_than_its_buffers() -> None:
    g = GatherAhead(HostCopies(), 16)
    with pytest.raises(InvalidArgument, match="does not fit"):
        g.take("a", _parts(_bytes(17, 1)))


# -- receive side: ScatterBehind -----------------------------------------------------------


class Commits:
    """on_done callbacks that record which chunk committed, and what its memory held then."""

    def __init__(self, dest: torch.Tensor) -> None:
        self.dest, self.done, self.seen = dest, list[int](), dict[int, bytes]()

    def of(self, index: int, span: slice) -> Callable[[], None]:
        def commit() -> None:
            self.done.append(index)
            self.seen[index] = bytes(self.dest[span].numpy())

        return commit


def _receive(s: ScatterBehind, data: torch.Tensor) -> None:
    view = s.sink(data.numel())
    view[:] = data.numpy().tobytes()


def test_scatter_commits_a_chunk_only_once_its_copy_completed() -> None:
    copies = LaterCopies()
    s = ScatterBehind(copies, 32)
    dest = torch.zeros(96, dtype=torch.uint8)
    log = Commits(dest)
    data = [_bytes(32, i) for i in range(3)]
    spans = [slice(32 * i, 32 * (i + 1)) for i in range(3)]
    _receive(s, data[0])
    s.issue([dest[spans[0]]], 0, log.of(0, spans[0]))
    assert s.settled() == []
    assert log.done == []
    assert s.pending == 1
    _receive(s, data[1])  # the other buffer: no wait
    assert log.done == []
    s.issue([dest[spans[1]]], 1, log.of(1, spans[1]))
    _receive(s, data[2])  # both busy: waits for chunk 0's copy, commits it, reuses its buffer
    assert log.done == [0]
    assert s.settled() == [0]
    s.issue([dest[spans[2]]], 2, log.of(2, spans[2]))
    assert s.flush() == [1, 2]
    assert s.pending == 0
    for i in range(3):  # every commit saw its chunk's bytes already in place
        assert log.seen[i] == bytes(data[i].numpy())
    assert bytes(dest.numpy()) == b"".join(bytes(d.numpy()) for d in data)


def test_scatter_commits_in_order_as_copies_finish_on_a_fast_device() -> None:
    s = ScatterBehind(LaterCopies(fast=True), 16)
    dest = torch.zeros(64, dtype=torch.uint8)
    log = Commits(dest)
    for i in range(4):
        _receive(s, _bytes(16, i))
        s.issue([dest[16 * i : 16 * (i + 1)]], i, log.of(i, slice(16 * i, 16 * (i + 1))))
        assert s.settled() == [i]  # polled: done at once, committed at once
    assert s.flush() == []
    assert log.done == [0, 1, 2, 3]


def test_scatter_a_buffer_received_into_but_never_issued_is_reused() -> None:
    copies = LaterCopies()
    s = ScatterBehind(copies, 16)
    dest = torch.zeros(16, dtype=torch.uint8)
    _receive(s, _bytes(16, 1))  # failed its checksum: never issued
    _receive(s, _bytes(16, 2))
    s.issue([dest], 7, lambda: None)
    assert s.flush() == [7]
    assert bytes(dest.numpy()) == bytes(_bytes(16, 2).numpy())
    with pytest.raises(InvalidArgument, match="sink"):
        s.issue([dest], 8, lambda: None)  # nothing received since


def test_scatter_a_failed_copy_commits_nothing_and_leaves_nothing_pending() -> None:
    copies = LaterCopies()
    s = ScatterBehind(copies, 16)
    dest = torch.zeros(32, dtype=torch.uint8)
    log = Commits(dest)
    for i in range(2):
        _receive(s, _bytes(16, i))
        s.issue([dest[16 * i : 16 * (i + 1)]], i, log.of(i, slice(16 * i, 16 * (i + 1))))
    copies.fail = True
    with pytest.raises(RuntimeError, match="simulated"):
        s.flush()
    assert log.done == []
    assert s.pending == 0
    assert s.settled() == []


def test_scatter_refuses_a_chunk_larger_than_its_buffers() -> None:
    s = ScatterBehind(HostCopies(), 16)
    with pytest.raises(InvalidArgument, match="does not fit"):
        s.sink(17)


# -- HeldVersion through a staging -----------------------------------------------------------


def _version(chunk_size: int = 4096) -> tuple[dict[str, torch.Tensor], Layout]:
    model = make_model(3, tiny=60, large=2, large_elems=9_000)
    return model, Layout.from_tensors(model, chunk_size=chunk_size)


def _payload(held: HeldVersion, index: int) -> bytes:
    return b"".join(bytes(v) for v in held.source_views(index))


def test_a_staged_chunk_is_present_only_after_its_copy_and_then_has_its_bytes() -> None:
    model, layout = _version()
    src = HeldVersion.publisher(TENANT, MODEL, 1, model, layout)
    dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate())
    staging = StagingBuffer(layout.chunk_size, copies=LaterCopies())
    for i in (0, 1):
        (view,) = dest.sink_views(i, staging)
        view[:] = _payload(src, i)
        dest.commit(i, src.checksum(i), staging)
        assert not dest.is_present(i)
    assert staging.pending == 2
    assert staging.flush() == [0, 1]
    for i in (0, 1):
        assert dest.is_present(i)
        assert _payload(dest, i) == _payload(src, i)
        assert dest.checksum(i) == src.checksum(i)


def test_a_chunk_received_again_does_not_rewrite_memory_already_served() -> None:
    model, layout = _version()
    src = HeldVersion.publisher(TENANT, MODEL, 1, model, layout)
    dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate())
    copies = LaterCopies()
    staging = StagingBuffer(layout.chunk_size, copies=copies)
    (view,) = dest.sink_views(0, staging)
    view[:] = _payload(src, 0)
    dest.commit(0, src.checksum(0), staging)
    staging.flush()
    issued = copies.issued
    (view,) = dest.sink_views(0, staging)
    view[:] = _payload(src, 0)
    dest.commit(0, src.checksum(0), staging)
    assert staging.flush() == [0]
    assert copies.issued == issued
    assert _payload(dest, 0) == _payload(src, 0)


def test_source_views_through_staging_are_the_chunk_bytes_and_their_checksum() -> None:
    model, layout = _version()
    direct = HeldVersion.publisher(TENANT, MODEL, 1, model, layout)
    staged = HeldVersion.publisher(TENANT, MODEL, 1, model, layout)
    staging = StagingBuffer(layout.chunk_size, copies=LaterCopies())
    n = layout.num_chunks
    assert n > 4
    for i in range(n):
        views = staged.source_views(i, staging, then=i + 1 if i + 1 < n else None)
        assert b"".join(bytes(v) for v in views) == _payload(direct, i)
        assert staged.checksum(i, staging) == direct.checksum(i)  # over the staged bytes
    staging.drain()


# -- over loopback TCP ----------------------------------------------------------------------


class Holder:
    """A holder whose every connection sends through `LaterCopies` staging (CPU memory)."""

    def __init__(self, held: HeldVersion, send: Callable[..., None] = send_chunk) -> None:
        self.copies: list[LaterCopies] = []
        store = HolderStore()
        store.add(held)
        self.server = HolderServer(store, allow_all, io_timeout=5, send=send, stage=self._stage)

    def _stage(self, held: HeldVersion) -> StagingBuffer:
        copies = LaterCopies()
        self.copies.append(copies)
        return StagingBuffer(held.layout.chunk_size, copies=copies)

    def __enter__(self) -> Source:
        self.server.start()
        return Source("h", *self.server.address)

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


def test_a_staged_holder_serves_every_byte_and_leaves_no_copy_running() -> None:
    model, layout = _version()
    src = HeldVersion.publisher(TENANT, MODEL, 1, model, layout)
    expected = [src.checksum(i) for i in range(layout.num_chunks)]
    holder = Holder(HeldVersion.publisher(TENANT, MODEL, 1, model, layout))  # sums on serve
    with holder as source:
        dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate())
        fetch(
            TENANT, MODEL, 1, layout, dest, [source], token=b"",
            deadline=time.monotonic() + 30, me=Topology(), parallel=2, expected=expected,
        )  # fmt: skip
    for name, t in model.items():
        assert torch.equal(dest.tensors[name], t)
    copies = holder.copies
    assert copies
    assert all(not c.queue for c in copies)
    segments = sum(len(layout.segments(i)) for i in range(layout.num_chunks))
    assert sum(c.issued for c in copies) == segments  # each chunk gathered once, summed too
    assert max(c.most for c in copies) == 2  # the next chunk gathering while one was sent


def _channel(
    source: Source, layout: Layout, copies: LaterCopies
) -> tuple[FetchState, StagingBuffer, TcpChannel]:
    dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate())
    f = FetchState(TENANT, MODEL, 1, dest, b"", time.monotonic() + 30, 5.0)
    staging = StagingBuffer(layout.chunk_size, copies=copies)
    return f, staging, TcpChannel(f, source, staging)


def _read(f: FetchState, channel: TcpChannel, chunks: list[int]) -> Iterator[ChunkOutcome]:
    """The channel's outcomes, each DONE checked to be committed when it is reported."""
    for out in channel.read(chunks):
        if out.status is ChunkStatus.DONE:
            assert f.dest.is_present(out.index), f"chunk {out.index} reported before committed"
        yield out


@pytest.mark.parametrize("fast", [False, True], ids=["slow-device", "fast-device"])
def test_a_staged_reader_reports_each_chunk_in_order_once_committed(fast: bool) -> None:
    model, layout = _version()
    src = HeldVersion.publisher(TENANT, MODEL, 1, model, layout)
    with Holder(HeldVersion.publisher(TENANT, MODEL, 1, model, layout)) as source:
        f, staging, channel = _channel(source, layout, LaterCopies(fast=fast))
        chunks = list(range(layout.num_chunks))
        try:
            outs = list(_read(f, channel, chunks))
        finally:
            channel.close()
    assert [o.index for o in outs] == chunks
    assert all(o.status is ChunkStatus.DONE for o in outs)
    assert staging.pending == 0
    assert f.dest.complete
    for name, t in model.items():
        assert torch.equal(f.dest.tensors[name], t)
    assert all(_payload(f.dest, i) == _payload(src, i) for i in chunks)


class DiesAfter:
    """A holder sender that sends `n` chunks, then breaks off (its process died)."""

    def __init__(self, n: int, *, corrupt: bool = False) -> None:
        self.n, self.sent, self.corrupt = n, 0, corrupt

    def __call__(
        self, conn: socket.socket, header: ChunkHeader, views: list[memoryview], complete: bool
    ) -> None:
        if self.sent == self.n:
            if not self.corrupt:
                raise OSError("holder died")
            data = bytearray(b"".join(views))
            data[0] ^= 0xFF
            views = [memoryview(data)]
        self.sent += 1
        send_chunk(conn, header, views, complete)


@pytest.mark.parametrize("corrupt", [False, True], ids=["dies", "corrupts"])
def test_a_batch_cut_mid_way_commits_exactly_the_chunks_copied_and_leaves_none_pending(
    corrupt: bool,
) -> None:
    model, layout = _version()
    src = HeldVersion.publisher(TENANT, MODEL, 1, model, layout)
    n = 5
    assert layout.num_chunks > n + 2
    held = HeldVersion.publisher(TENANT, MODEL, 1, model, layout)
    with Holder(held, send=DiesAfter(n, corrupt=corrupt)) as source:
        f, staging, channel = _channel(source, layout, LaterCopies())
        try:
            outs = list(_read(f, channel, list(range(layout.num_chunks))))
        finally:
            channel.close()
    assert [o.status for o in outs] == [ChunkStatus.DONE] * n + [
        ChunkStatus.CORRUPT if corrupt else ChunkStatus.FAILED
    ]
    assert [o.index for o in outs] == list(range(n + 1))
    assert staging.pending == 0
    present = [i for i in range(layout.num_chunks) if f.dest.is_present(i)]
    assert present == list(range(n))
    for i in present:
        assert _payload(f.dest, i) == _payload(src, i)


def test_closing_a_channel_mid_batch_completes_its_pending_copies() -> None:
    model, layout = _version()
    src = HeldVersion.publisher(TENANT, MODEL, 1, model, layout)
    with Holder(HeldVersion.publisher(TENANT, MODEL, 1, model, layout)) as source:
        copies = LaterCopies()
        f, staging, channel = _channel(source, layout, copies)
        outs = channel.read(list(range(layout.num_chunks)))
        first = next(outs)  # chunk 0: reported when chunk 2 needed its buffer
        assert first.index == 0
        assert staging.pending == 2
        channel.close()  # the reader gave up on the batch: chunks 1 and 2 are copied
        assert staging.pending == 0
        assert not copies.queue
    present = [i for i in range(layout.num_chunks) if f.dest.is_present(i)]
    assert present == [0, 1, 2]
    for i in present:
        assert _payload(f.dest, i) == _payload(src, i)
