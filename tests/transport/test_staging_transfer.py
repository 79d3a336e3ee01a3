"""Staged transfers on the CPU (transport/staging.py): `HeldVersion` through a staging,
a staged holder server, and a staged reader's TCP channel, over loopback, with copies that
land only when waited for (`LaterCopies`, tests/transport/_later_copies.py): a chunk is
present and reported only once its copy completed, and nothing is left pending when a
batch is cut or a channel closed.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from tests.transport._later_copies import LaterCopies
from tests.transport._model import MODEL, TENANT, make_model
from tests.transport.open_verifier import allow_all
from transport.fetch_state import FetchState
from transport.layout import Layout
from transport.outcome import ChunkOutcome, ChunkStatus
from transport.planner import Source
from transport.reader import fetch
from transport.server import HolderServer, send_chunk
from transport.staging import StagingBuffer
from transport.store import HeldVersion, HolderStore
from transport.tcp import TcpChannel
from transport.topology import Topology
from transport.wire import ChunkHeader

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
