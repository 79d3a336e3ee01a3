"""The holder port under hostile input: clean errors, closed connections, still serving."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.transport._model import MODEL, TENANT, make_model
from tests.transport.open_verifier import allow_all
from transport.layout import Layout
from transport.reader import Source, fetch
from transport.server import HolderServer
from transport.store import HeldVersion, HolderStore
from transport.topology import Topology
from transport.wire import (
    HEADER,
    MAGIC,
    WIRE_VERSION,
    ErrorCode,
    FrameType,
    GetRequest,
    encode_get,
    read_frame,
)

MODEL_T = make_model(2, tiny=5, large=1, large_elems=1000)
LAYOUT = Layout.from_tensors(MODEL_T, chunk_size=4096)


@pytest.fixture(scope="module")
def server() -> Iterator[HolderServer]:
    store = HolderStore()
    store.add(HeldVersion.publisher(TENANT, MODEL, 1, MODEL_T, LAYOUT))
    with HolderServer(store, allow_all, io_timeout=1.0) as srv:
        yield srv


def _exchange(addr: tuple[str, int], data: bytes) -> bytes:
    """Send `data`, half-close, and read until the server closes (bounded)."""
    with socket.create_connection(addr, timeout=3) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return b""  # the server already hung up on us: fine
        chunks = []
        while True:
            try:
                got = sock.recv(65536)
            except ConnectionResetError:
                break
            if not got:
                break
            chunks.append(got)
        return b"".join(chunks)


def _fetch_ok(addr: tuple[str, int]) -> None:
    dest = HeldVersion.reader(TENANT, MODEL, 1, LAYOUT, LAYOUT.allocate())
    fetch(
        TENANT,
        MODEL,
        1,
        LAYOUT,
        dest,
        [Source("h", *addr)],
        token=b"",
        me=Topology(),
        deadline=time.monotonic() + 5,
    )
    assert dest.complete


def _error_code(reply: bytes) -> int:
    magic, _, ftype, _, _ = HEADER.unpack(reply[: HEADER.size])
    assert magic == MAGIC
    assert ftype == FrameType.ERROR
    return int(struct.unpack("!H", reply[HEADER.size : HEADER.size + 2])[0])


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.one_of(
        st.binary(max_size=300),
        st.binary(max_size=100).map(lambda b: MAGIC + b),  # right magic, junk after it
        st.binary(max_size=100).map(lambda b: MAGIC + bytes([WIRE_VERSION, FrameType.GET]) + b),
    )
)
def test_garbage_never_breaks_the_server(server: HolderServer, data: bytes) -> None:
    _exchange(server.address, data)
    _fetch_ok(server.address)


@pytest.mark.parametrize(
    ("header", "code"),
    [
        (HEADER.pack(b"HTTP", 1, 1, 0, 0), ErrorCode.BAD_FRAME),
        (HEADER.pack(MAGIC, 99, 1, 0, 0), ErrorCode.UNSUPPORTED_VERSION),
        (HEADER.pack(MAGIC, WIRE_VERSION, 1, 0, 2**31), ErrorCode.TOO_LARGE),
        (HEADER.pack(MAGIC, WIRE_VERSION, 77, 0, 0), ErrorCode.BAD_FRAME),
        (HEADER.pack(MAGIC, WIRE_VERSION, FrameType.GET, 0, 3) + b"abc", ErrorCode.BAD_REQUEST),
    ],
)
def test_bad_frames_get_a_named_error(server: HolderServer, header: bytes, code: int) -> None:
    assert _error_code(_exchange(server.address, header)) == code
    _fetch_ok(server.address)


def test_truncated_frame_is_closed_after_io_timeout(server: HolderServer) -> None:
    with socket.create_connection(server.address, timeout=5) as sock:
        sock.sendall(HEADER.pack(MAGIC, WIRE_VERSION, FrameType.GET, 0, 100) + b"x")
        start = time.monotonic()
        assert sock.recv(100) == b""  # server gave up on the missing body and closed
        assert time.monotonic() - start < 3
    _fetch_ok(server.address)


def test_unknown_version_and_out_of_range_chunk(server: HolderServer) -> None:
    for version, chunks, code in [
        (9, (0,), ErrorCode.NOT_HELD),
        (1, (10_000,), ErrorCode.BAD_REQUEST),
    ]:
        req = GetRequest(TENANT, MODEL, version, LAYOUT.digest, b"", chunks, 0)
        with socket.create_connection(server.address, timeout=3) as sock:
            sock.sendall(encode_get(req))
            ftype, body = read_frame(sock)
            assert ftype is FrameType.ERROR
            assert struct.unpack("!H", body[:2])[0] == code
