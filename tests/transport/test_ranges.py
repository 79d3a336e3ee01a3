"""GET_RANGES: byte ranges within chunks, from a real holder port (docs/transport.md).

A reader asks for the bytes it needs and receives exactly those, written where they go;
a holder that corrupts them, a range the frame or the holder refuses, and a holder that
does not know the frame each end in an error of its own name, with nothing marked present.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from chaos.holder_faults import Fault
from tensorhub.errors import BadRange, IntegrityError, RangesUnsupported, TransportError
from tests.transport._model import MODEL, TENANT, make_model
from tests.transport.open_verifier import allow_all
from tests.waiting import wait_until
from transport.layout import Layout
from transport.ranged import ranged_views, read_ranges
from transport.reader import Source, fetch
from transport.server import HolderServer, send_chunk
from transport.store import HeldVersion, HolderStore
from transport.topology import Topology
from transport.wire import (
    GET_FIXED,
    MAX_RANGES_PER_GET,
    ChunkRange,
    ErrorCode,
    FrameType,
    RangeRequest,
    decode_error,
    decode_get_ranges,
    encode_error,
    encode_get_ranges,
    read_frame,
)

MODEL_T = make_model(3, tiny=5, large=2, large_elems=5000)
LAYOUT = Layout.from_tensors(MODEL_T, chunk_size=4096)
RANGES = [
    ChunkRange(0, 100, 200),
    ChunkRange(0, 1000, 8),
    ChunkRange(2, 0, 4096),
    ChunkRange(3, 4000, 96),
]


def _flat(tensors: dict[str, torch.Tensor], layout: Layout, chunk: int) -> bytes:
    held = HeldVersion.reader(TENANT, MODEL, 1, layout, tensors)
    return b"".join(bytes(v) for v in held.source_views(chunk))


class _Holder:
    """A holder of MODEL_T@1 that counts the payload bytes it serves."""

    def __init__(self, fault: Fault | None = None) -> None:
        self.served = 0
        self.store = HolderStore()
        self.store.add(HeldVersion.publisher(TENANT, MODEL, 1, MODEL_T, LAYOUT))
        self.server = HolderServer(
            self.store, allow_all, io_timeout=2.0, on_served=self._count,
            send=fault if fault is not None else send_chunk,
        )  # fmt: skip

    def _count(self, n: int) -> None:
        self.served += n

    def source(self) -> Source:
        return Source("h", *self.server.address)


@pytest.fixture
def holder() -> Iterator[_Holder]:
    h = _Holder()
    with h.server:
        yield h


def _reader() -> HeldVersion:
    return HeldVersion.reader(TENANT, MODEL, 1, LAYOUT, LAYOUT.allocate())


def test_a_reader_receives_exactly_the_ranges_it_asked_for(holder: _Holder) -> None:
    dest = _reader()
    got = read_ranges(holder.source(), dest, RANGES, token=b"", deadline=time.monotonic() + 5)
    want = sum(r.length for r in RANGES)
    # the holder counts a range once its send returned, which may be after the reader
    # received it: wait for the count, then compare it exactly
    wait_until("the holder counted the ranges it sent", lambda: holder.served >= want, 5)
    assert got == want == holder.served
    assert want < len({r.chunk for r in RANGES}) * LAYOUT.chunk_size  # less than whole chunks
    for r in RANGES:
        published = _flat(MODEL_T, LAYOUT, r.chunk)[r.offset : r.offset + r.length]
        mine = b"".join(
            bytes(v) for v in ranged_views(dest.source_views(r.chunk), r.offset, r.length)
        )
        assert mine == published
    assert len(dest.missing()) == LAYOUT.num_chunks  # nothing marked present: unverified
    # the same connection still serves whole chunks (GET unchanged)
    whole = _reader()
    fetch(
        TENANT, MODEL, 1, LAYOUT, whole, [holder.source()], token=b"", me=Topology(),
        deadline=time.monotonic() + 5,
    )  # fmt: skip
    assert whole.complete


def test_a_holder_that_corrupts_a_range_is_named() -> None:
    h = _Holder(Fault(corrupt=True))
    with h.server:
        dest = _reader()
        with pytest.raises(IntegrityError, match="failed its checksum"):
            read_ranges(h.source(), dest, RANGES, token=b"", deadline=time.monotonic() + 5)
    assert len(dest.missing()) == LAYOUT.num_chunks


def test_a_holder_that_lies_about_the_version_is_named() -> None:
    h = _Holder(Fault(wrong_version=True))
    with h.server, pytest.raises(IntegrityError, match="policy@2"):
        read_ranges(h.source(), _reader(), RANGES, token=b"", deadline=time.monotonic() + 5)


def test_ranges_the_frame_refuses_are_refused_by_name_before_any_io(holder: _Holder) -> None:
    dest, soon = _reader(), time.monotonic() + 5
    too_many = [ChunkRange(0, 0, 1)] * (MAX_RANGES_PER_GET + 1)
    for bad, why in [
        ([], "1..4096"),
        (too_many, "1..4096"),
        ([ChunkRange(0, 10, 0)], "empty"),
        ([ChunkRange(0, 4000, 97)], "passes its 4096 bytes"),
        ([ChunkRange(LAYOUT.num_chunks, 0, 1)], "names chunk"),
    ]:
        with pytest.raises(BadRange, match=why):
            read_ranges(holder.source(), dest, bad, token=b"", deadline=soon)
    assert holder.served == 0
    req = RangeRequest(TENANT, MODEL, 1, LAYOUT.digest, b"", (ChunkRange(0, 0, 0),), 0)
    with pytest.raises(BadRange, match="empty"):
        encode_get_ranges(req)


def _ask(addr: tuple[str, int], frame: bytes) -> tuple[FrameType, bytearray]:
    with socket.create_connection(addr, timeout=3) as sock:
        sock.sendall(frame)
        return read_frame(sock)


def test_the_holder_refuses_a_range_past_its_chunk_and_a_crafted_empty_one(
    holder: _Holder,
) -> None:
    past = RangeRequest(TENANT, MODEL, 1, LAYOUT.digest, b"", (ChunkRange(1, 4000, 200),), 0)
    ftype, body = _ask(holder.server.address, encode_get_ranges(past))
    assert ftype is FrameType.ERROR
    refusal = decode_error(body)
    assert refusal.code is ErrorCode.BAD_REQUEST
    assert "passes its 4096 bytes" in refusal.message
    # an empty range, written past the encoder's check: the decoder refuses it by name
    ok = RangeRequest(TENANT, MODEL, 1, LAYOUT.digest, b"", (ChunkRange(1, 0, 1),), 0)
    frame = bytearray(encode_get_ranges(ok))
    frame[-4:] = struct.pack("!I", 0)
    with pytest.raises(BadRange, match="empty"):
        decode_get_ranges(frame[12:])
    ftype, body = _ask(holder.server.address, bytes(frame))
    refusal = decode_error(body)
    assert refusal.code is ErrorCode.BAD_REQUEST
    assert "empty" in refusal.message
    # a count of ranges over the bound, in a frame that is otherwise well formed
    frame = bytearray(encode_get_ranges(ok))
    struct.pack_into("!H", frame, 12 + GET_FIXED.size - 2, MAX_RANGES_PER_GET + 1)
    with pytest.raises(BadRange, match="4097 ranges"):
        decode_get_ranges(frame[12:])
    assert holder.served == 0


def test_a_holder_that_does_not_know_the_frame_is_named_so_the_reader_reads_whole() -> None:
    """An older holder answers an unknown frame type BAD_FRAME (`wire.parse_header`)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def old_holder() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(encode_error(ErrorCode.BAD_FRAME, "unknown frame type 4"))

    t = threading.Thread(target=old_holder, daemon=True)
    t.start()
    try:
        with pytest.raises(RangesUnsupported, match="unknown frame type 4"):
            read_ranges(
                Source("old", *listener.getsockname()), _reader(), RANGES, token=b"",
                deadline=time.monotonic() + 5,
            )  # fmt: skip
    finally:
        t.join(5)
        listener.close()
    assert issubclass(RangesUnsupported, TransportError)
