"""Slowloris on a holder's data port (issue 12 item 4), played against a real HolderServer.

Idle or byte-trickling TCP connections, no token needed, used to hold every connection slot
so that every legitimate reader was answered BUSY (-> VersionUnavailable) for as long as
the attacker liked. The attacks come from real sockets on loopback, from several source
addresses (127.0.0.2... are local on Linux) so that the per-peer bound is not what stops
them; the reader reads from 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorhub.errors import TransportError
from tests.ros.test_tls import make_pki
from tests.transport._model import MODEL, TENANT, make_model
from tests.transport._sockets import WAIT, closed_by_peer, trickle
from tests.transport.open_verifier import allow_all
from transport.layout import Layout
from transport.reader import Source, fetch
from transport.server import HolderServer
from transport.store import HeldVersion, HolderStore
from transport.topology import Topology
from transport.wire import (
    HEADER,
    MAGIC,
    MAX_BODY,
    WIRE_VERSION,
    FrameType,
    GetRequest,
    decode_chunk_header,
    decode_error,
    encode_get,
    read_frame,
)

CHUNK = 64 * 1024
# What a slowloris trickles: a valid GET header announcing the largest body, then that body,
# one byte at a time, so no byte it sends ever lets the holder refuse it as malformed.
SLOW_FRAME = HEADER.pack(MAGIC, WIRE_VERSION, FrameType.GET, 0, MAX_BODY) + bytes(MAX_BODY)


@contextlib.contextmanager
def _holder(**opts: Any) -> Iterator[tuple[HolderServer, Layout, dict[str, torch.Tensor]]]:
    model = make_model(3, tiny=50)
    layout = Layout.from_tensors(model, chunk_size=CHUNK)
    store = HolderStore()
    store.add(HeldVersion.publisher(TENANT, MODEL, 1, model, layout))
    opts.setdefault("io_timeout", 30.0)
    with HolderServer(store, allow_all, **opts) as server:
        yield server, layout, dict(model)


def _connect(server: HolderServer, source_ip: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(server.address, timeout=WAIT, source_address=(source_ip, 0))


def _get_one_chunk(sock: socket.socket, layout: Layout) -> None:
    """Send a valid GET for chunk 0 and read the whole answer (raises on ERROR)."""
    sock.sendall(encode_get(GetRequest(TENANT, MODEL, 1, layout.digest, b"t", (0,), 0)))
    ftype, body = read_frame(sock)
    if ftype is FrameType.ERROR:
        raise decode_error(body).error()
    header = decode_chunk_header(body)
    left = header.length
    while left:
        got = sock.recv(min(left, 1 << 20))
        assert got, "holder closed mid-payload"
        left -= len(got)


def _refused_busy(sock: socket.socket) -> bool:
    """True if the holder answered `sock` with a BUSY ERROR frame (and closed it)."""
    sock.settimeout(WAIT)
    try:
        ftype, body = read_frame(sock)
    except TransportError:
        return False
    if ftype is not FrameType.ERROR:
        return False
    with pytest.raises(TransportError, match="BUSY"):
        raise decode_error(body).error()
    return True


@pytest.mark.timeout(120)
def test_slow_connections_at_and_beyond_the_limit_do_not_lock_readers_out() -> None:
    """48 connections (3x the limit of 16) from four addresses, each trickling a byte of a
    frame header every 0.5 s (well inside the 5 s I/O timeout, so none ever times out);
    a reader's fetch then succeeds at once: unauthenticated connections are evicted."""
    with _holder(max_connections=16, per_peer=12, frame_timeout=60, io_timeout=5) as (
        server,
        layout,
        model,
    ):
        attackers = [
            _connect(server, f"127.0.0.{2 + i % 4}") for i in range(48)
        ]  # at the limit and beyond it
        stop = threading.Event()

        def trickle_all() -> None:
            for i in range(int(WAIT / 0.5)):  # bounded: at most WAIT seconds
                for sock in attackers:
                    with contextlib.suppress(OSError):
                        sock.send(SLOW_FRAME[i : i + 1])
                if stop.wait(0.5):
                    return

        thread = threading.Thread(target=trickle_all, daemon=True)
        thread.start()
        try:
            dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate())
            stats = fetch(
                TENANT, MODEL, 1, layout, dest, [Source("h", *server.address)],
                token=b"t", deadline=time.monotonic() + WAIT, me=Topology(), parallel=4,
            )  # fmt: skip
        finally:
            stop.set()
            thread.join(timeout=WAIT)
            for sock in attackers:
                sock.close()
    assert dest.complete
    assert all(
        torch.equal(dest.tensors[k].view(torch.uint8), t.view(torch.uint8))
        for k, t in model.items()
    )
    assert stats.failed_sources == {}
    assert stats.total_bytes == sum(layout.payload_bytes(i) for i in range(layout.num_chunks))


@pytest.mark.timeout(120)
def test_idle_and_trickling_connections_are_closed_after_the_frame_deadline() -> None:
    """A connection that sends nothing, and one that sends a byte every 0.2 s, are both
    closed by the holder once the 1 s frame deadline passes, though the I/O timeout is 60 s."""
    with _holder(frame_timeout=1.0, io_timeout=2 * WAIT) as (server, _, _):
        start = time.monotonic()
        idle, slow = _connect(server), _connect(server)
        stop = threading.Event()

        thread = threading.Thread(target=trickle, args=(slow, SLOW_FRAME, stop), daemon=True)
        thread.start()
        try:
            assert closed_by_peer(idle)
            assert closed_by_peer(slow)
            assert time.monotonic() - start >= 1.0  # not before its deadline
        finally:
            stop.set()
            thread.join(timeout=WAIT)
            idle.close()
            slow.close()


@pytest.mark.timeout(60)
def test_a_served_connection_may_idle_between_requests_longer_than_the_frame_deadline() -> None:
    """The frame deadline is for a request in progress: a reader that has been served keeps
    its connection while it idles between GETs (up to the I/O timeout)."""
    with _holder(frame_timeout=0.5, io_timeout=30) as (server, layout, _), _connect(server) as sock:
        _get_one_chunk(sock, layout)
        time.sleep(2.0)  # four frame deadlines
        _get_one_chunk(sock, layout)


@pytest.mark.timeout(60)
def test_per_peer_bound_refuses_one_address_and_admits_another() -> None:
    """With `per_peer=4` and 4 served connections from 127.0.0.1, the 5th from there is
    answered BUSY while the holder has free slots, and one from 127.0.0.2 is served. (With
    token-less ones at the bound, the 5th evicts one instead: test_hostile_ports.py.)"""
    with _holder(max_connections=64, per_peer=4, frame_timeout=60) as (server, layout, _):
        held = [_connect(server) for _ in range(4)]
        try:
            for sock in held:
                _get_one_chunk(sock, layout)
            with _connect(server) as fifth:
                assert _refused_busy(fifth)
            with _connect(server, "127.0.0.2") as other:
                _get_one_chunk(other, layout)
        finally:
            for sock in held:
                sock.close()


@pytest.mark.timeout(60)
def test_served_connections_are_not_evicted_when_the_holder_is_full() -> None:
    """Only unauthenticated connections are evicted: when every slot has presented a valid
    read token, a newcomer is refused BUSY and the served connections keep working."""
    with _holder(max_connections=2, per_peer=8, frame_timeout=60) as (server, layout, _):
        served = [_connect(server) for _ in range(2)]
        try:
            for sock in served:
                _get_one_chunk(sock, layout)
            with _connect(server) as newcomer:
                assert _refused_busy(newcomer)
            for sock in served:
                _get_one_chunk(sock, layout)
        finally:
            for sock in served:
                sock.close()


@pytest.mark.timeout(120)
def test_a_tls_handshake_trickled_a_byte_at_a_time_is_closed_after_the_frame_deadline(
    tmp_path: Path,
) -> None:
    """On a TLS port the first frame's deadline covers the handshake: a peer that sends its
    ClientHello a byte every 0.2 s (each read well inside the 60 s I/O timeout) is closed."""
    tls = make_pki(tmp_path, "slow")
    hello = bytearray()
    client = tls.client_context().wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO())
    with contextlib.suppress(ssl.SSLWantReadError):
        client.do_handshake()
    hello += out.read()  # a real ClientHello, to be trickled
    with _holder(frame_timeout=1.0, io_timeout=2 * WAIT, tls=tls) as (server, _, _):
        start = time.monotonic()
        slow = _connect(server)
        stop = threading.Event()

        thread = threading.Thread(target=trickle, args=(slow, hello, stop), daemon=True)
        thread.start()
        try:
            assert closed_by_peer(slow)
            assert time.monotonic() - start >= 1.0
        finally:
            stop.set()
            thread.join(timeout=WAIT)
            slow.close()
