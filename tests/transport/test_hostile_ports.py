"""Hostile peers on a holder's data port, and a trickling holder (issue 25, items 4 and 6).

Each test plays the attack against real sockets on loopback and fails on the code before
the fix (35d0b56):

- **Token-less flood from the readers' own host.** A process on the readers' host keeps
  `per_peer` (64) connections that never send a token, replacing each one every 8 s and
  any the holder closes at once, so the 10 s frame deadline never frees a slot. Before,
  the per-peer bound refused every newcomer from that host BUSY and never evicted the
  flood, so legitimate fetches failed; now a newcomer evicts the peer's oldest token-less
  connection (`transport.admission`).
- **A holder full of readers.** When every slot of the host is a connection that
  presented a valid read token, a newcomer is still refused BUSY. Before, the SDK
  suspected the holder at the first BUSY and failed within a second with most of its
  deadline left; now it asks again under its retry policy (`HOLDER_BUSY`) until the
  deadline, and reads once a slot frees.
- **A trickling holder.** One byte of the CHUNK frame every 0.9 windows is never silent
  for a window. Before, the rate floor judged a window only when the next byte came after
  it, so the trickler held the reader about 1.8 windows (8 s at the default 5 s window);
  now the verdict comes at the window's end (`transport.pace`).
"""

from __future__ import annotations

import collections
import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import ros
from ros.client.manifest import layout_of
from tensorhub.errors import SlowHolder, TransportError
from tests.ros.conftest import connect, hub_server, make_tenant  # noqa: F401 (fixtures)
from tests.ros.helpers import digest, make_model
from tests.ros.test_tls import make_pki
from tests.transport._model import MODEL, TENANT
from tests.transport._model import make_model as make_tiny_model
from tests.transport.open_verifier import allow_all
from tests.waiting import wait_until
from transport.layout import Layout
from transport.netio import arm, recv_views
from transport.pace import Pace
from transport.reader import Source, fetch
from transport.server import PER_PEER, HolderServer
from transport.store import HeldVersion, HolderStore
from transport.topology import Topology
from transport.wire import (
    ChunkHeader,
    FrameType,
    GetRequest,
    decode_chunk_header,
    decode_error,
    encode_chunk_header,
    encode_get,
    read_frame,
)

WAIT = 30.0  # bound on any wait in these tests (a noisy shared machine)


class TokenlessFlood:
    """`count` connections to `address` from 127.0.0.1 that never send a byte. Every
    `period / count` seconds the oldest is replaced, and any the holder closed (evicted or
    expired) too, so `count` are open again within a tick: a process that reconnects every
    `period` seconds, under the frame deadline, and tops up at once. Bounded: it stops at
    `close()` or after `WAIT` seconds."""

    def __init__(self, address: tuple[str, int], count: int = PER_PEER, period: float = 8.0):
        self._address, self._count, self._tick = address, count, period / count
        self._socks: collections.deque[socket.socket] = collections.deque()
        self.opened = 0
        self.cut = 0  # of its connections, those the holder closed (evicted, or expired)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        for _ in range(count):
            self._open()
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)
        self._thread.start()

    def _open(self) -> None:
        with contextlib.suppress(OSError):
            self._socks.append(socket.create_connection(self._address, timeout=5))
            self.opened += 1

    def _run(self) -> None:
        end = time.monotonic() + WAIT
        while not self._stop.wait(self._tick) and time.monotonic() < end:
            with self._lock:
                self._drop_cut(0)  # first: an eviction takes the oldest, as rotation does
                if self._socks:
                    self._socks.popleft().close()  # none waits out the frame deadline
                while len(self._socks) < self._count:
                    self._open()

    def _drop_cut(self, wait: float) -> None:
        """Forget the connections the holder closed (or wrote BUSY to and closed)."""
        for sock in select.select(list(self._socks), [], [], wait)[0]:
            sock.close()
            self._socks.remove(sock)
            self.cut += 1

    def count_cut(self, wait: float = 2.0) -> int:
        """`cut`, after waiting up to `wait` s for the holder to close one if none is yet."""
        with self._lock:
            self._drop_cut(wait if not self.cut else 0)
            return self.cut

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=WAIT)
        for sock in self._socks:
            sock.close()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return digest(a) == digest(b)


@pytest.mark.timeout(120)
def test_a_token_less_flood_from_the_readers_host_is_evicted(
    connect: Callable[..., ros.Hub],  # noqa: F811
) -> None:
    """Six versions published and fetched (`timeout=10`) while 64 token-less connections
    from the readers' own address hold the trainer's data port: every fetch succeeds, and
    the flood's connections were evicted to admit the readers' (it had to reopen some)."""
    trainer = connect(topology={"host": "trainer"})
    reader = connect(topology={"host": "rollout"})
    trainer.publish("policy", 1, make_model(1))  # starts the trainer's holder port
    holder = trainer._serving.server
    flood = TokenlessFlood(holder.address)
    failures: list[str] = []
    try:
        wait_until("the flood holds every slot", lambda: len(holder.admission) >= PER_PEER)
        for version in range(2, 8):
            weights = make_model(version)
            trainer.publish("policy", version, weights)
            try:
                held = reader.fetch("policy", version, timeout=10)
            except Exception as exc:  # counted, so the figure says how many failed
                failures.append(f"v{version}: {exc!r}")
                continue
            assert _same(held.tensors, weights)
        cut = flood.count_cut()
    finally:
        flood.close()
    assert failures == []
    assert cut > 0  # the readers' connections evicted some of the flood's


def _read_chunk(sock: socket.socket, get: bytes) -> None:
    """Send the GET `get` (of one chunk) on `sock` and read the whole answer."""
    sock.sendall(get)
    ftype, body = read_frame(sock)
    if ftype is FrameType.ERROR:
        raise decode_error(body).error()
    left = decode_chunk_header(body).length
    while left:
        got = sock.recv(min(left, 1 << 20))
        assert got, "holder closed mid-payload"
        left -= len(got)


def _tokened(
    address: tuple[str, int], tenant: str, resolved: object, count: int
) -> list[socket.socket]:
    """`count` connections to a holder from 127.0.0.1, each served one chunk with a valid
    read token for `policy`@1 and then left idle: readers the holder may never evict."""
    manifest = resolved.manifest  # type: ignore[attr-defined]
    layout = layout_of(manifest)
    request = GetRequest(
        tenant, "policy", 1, layout.digest,
        bytes(resolved.read_token), (0,), 0,  # type: ignore[attr-defined]
    )  # fmt: skip
    socks = []
    for _ in range(count):
        socks.append(socket.create_connection(address, timeout=WAIT))
        _read_chunk(socks[-1], encode_get(request))
    return socks


@pytest.mark.timeout(120)
def test_the_sdk_waits_out_a_holder_full_of_readers(
    connect: Callable[..., ros.Hub],  # noqa: F811
) -> None:
    """The trainer's port holds 64 served connections from 127.0.0.1, so a reader there is
    answered BUSY; they leave 1.5 s later. `fetch(timeout=10)` reads the version once they
    have gone, with the trainer never suspected (before: `VersionUnavailable` at once)."""
    trainer = connect(topology={"host": "trainer"})
    reader = connect(topology={"host": "rollout"})
    weights = make_model(3)
    trainer.publish("policy", 1, weights)
    resolved = reader.resolve("policy", 1)
    readers = _tokened(trainer._serving.server.address, trainer.tenant, resolved, PER_PEER)

    def leave() -> None:
        for sock in readers:
            sock.close()

    release = threading.Timer(1.5, leave)
    start = time.monotonic()
    release.start()
    try:
        held = reader.fetch("policy", 1, timeout=10)
    finally:
        release.cancel()
        for sock in readers:
            sock.close()
    took = time.monotonic() - start
    assert _same(held.tensors, weights)
    assert held.stats.failed_sources == {}
    assert took >= 1.4  # it waited for a slot: nothing was read while the port was full


class OneByteEvery:
    """A holder's chunk sender that sends each CHUNK frame (header and payload) one byte
    every `gap` seconds: never silent for a stall window of more than `gap`. It records
    when it sent the first byte and when the reader hung up (the wait for the next byte
    watches the socket), so a test can tell how long the trickler held the reader."""

    def __init__(self, gap: float) -> None:
        self.gap = gap
        self.first: float | None = None
        self.hung_up: float | None = None

    def __call__(
        self, conn: socket.socket, header: ChunkHeader, views: list[memoryview], complete: bool
    ) -> None:
        frame = encode_chunk_header(header, complete=complete) + b"".join(bytes(v) for v in views)
        for i in range(min(len(frame), int(WAIT / self.gap))):  # bounded: WAIT seconds
            conn.sendall(frame[i : i + 1])
            if self.first is None:
                self.first = time.monotonic()
            if select.select([conn], [], [], self.gap)[0]:  # the reader closed (EOF)
                self.hung_up = time.monotonic()
                raise ConnectionResetError("reader hung up")


@pytest.mark.timeout(90)
def test_a_trickler_is_abandoned_within_one_window_of_its_first_byte() -> None:
    """The trickler (ranked first) sends one byte every 0.9 stall windows; a good holder
    has every chunk. The reader hangs up on the trickler within one window of its first
    byte, plus scheduling slack (before: at its third byte, 1.8 windows), reports it slow,
    and reads everything from the good holder."""
    window = 3.0
    model = make_tiny_model(25, tiny=20)
    layout = Layout.from_tensors(model, chunk_size=64 * 1024)
    trickler = OneByteEvery(gap=0.9 * window)
    servers = []
    sources = []
    for name, send in (("a-trickler", trickler), ("b-good", None)):
        store = HolderStore()
        store.add(HeldVersion.publisher(TENANT, MODEL, 1, model, layout))
        opts = {} if send is None else {"send": send}
        servers.append(HolderServer(store, allow_all, io_timeout=WAIT, **opts).start())  # type: ignore[arg-type]
        sources.append(Source(name, *servers[-1].address))
    try:
        dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate())
        stats = fetch(
            TENANT, MODEL, 1, layout, dest, sources, token=b"t",
            deadline=time.monotonic() + WAIT, me=Topology(), parallel=2, stall_timeout=window,
        )  # fmt: skip
    finally:
        for server in servers:
            server.stop()
    assert dest.complete
    assert _same(dest.tensors, model)
    assert "SlowHolder" in stats.failed_sources["a-trickler"]
    assert trickler.first is not None
    assert trickler.hung_up is not None
    held = trickler.hung_up - trickler.first
    assert window * 0.95 <= held < window * 1.4, held  # old: ~1.8 windows


@pytest.mark.timeout(90)
def test_a_tls_holder_gone_silent_is_abandoned_at_the_stall_timeout(tmp_path: Path) -> None:
    """Over mutual TLS the holder sends one byte of a CHUNK frame and then nothing. The
    reader hangs up within about a window (stall 1 s) and reads from the good holder.
    Before, a TLS socket retried every read the kernel timed out, so neither the stall
    timeout nor the rate floor ever fired and the reader waited for its deadline."""
    window = 1.0
    tls = make_pki(tmp_path, "quiet")
    model = make_tiny_model(26, tiny=20)
    layout = Layout.from_tensors(model, chunk_size=64 * 1024)
    quiet = OneByteEvery(gap=WAIT)  # its first byte, then silence until the reader hangs up
    servers, sources = [], []
    for name, send in (("a-quiet", quiet), ("b-good", None)):
        store = HolderStore()
        store.add(HeldVersion.publisher(TENANT, MODEL, 1, model, layout))
        opts = {} if send is None else {"send": send}
        servers.append(HolderServer(store, allow_all, io_timeout=WAIT, tls=tls, **opts).start())  # type: ignore[arg-type]
        sources.append(Source(name, *servers[-1].address))
    try:
        dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate())
        stats = fetch(
            TENANT, MODEL, 1, layout, dest, sources, token=b"t", tls=tls,
            deadline=time.monotonic() + 20, me=Topology(), parallel=2, stall_timeout=window,
        )  # fmt: skip
    finally:
        for server in servers:
            server.stop()
    assert dest.complete
    assert _same(dest.tensors, model)
    assert "a-quiet" in stats.failed_sources
    assert quiet.first is not None
    assert quiet.hung_up is not None
    assert quiet.hung_up - quiet.first < 3 * window  # old: the 20 s deadline


def test_a_burst_then_a_trickle_is_judged_when_it_falls_under_the_floor() -> None:
    """On a socket pair: the peer sends 1.2 windows' worth of the floor at once, then one
    byte every 0.9 windows (never silent for a window). Its average falls under the floor
    1.2 windows in, and that is when it is judged (before: at the byte after the window's
    end, 1.8 windows in)."""
    window, floor = 2.0, 64 * 1024
    burst = int(1.2 * floor * window)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        stop = threading.Event()

        def peer() -> None:
            theirs.sendall(bytes(burst))
            for _ in range(4):  # bounded: 3.6 windows
                if stop.wait(0.9 * window):
                    return
                with contextlib.suppress(OSError):
                    theirs.sendall(b"x")

        thread = threading.Thread(target=peer, daemon=True)
        thread.start()
        buf = bytearray(burst + 16)  # more than the peer will ever send
        start = time.monotonic()
        arm(ours, start + WAIT, window)
        try:
            with pytest.raises(SlowHolder):
                recv_views(ours, [memoryview(buf)], meter=Pace(floor, window, ours))
            took = time.monotonic() - start
        finally:
            stop.set()
            thread.join(timeout=WAIT)
    assert 1.15 * window <= took < 1.5 * window, took


@contextlib.contextmanager
def _holder() -> Iterator[tuple[HolderServer, Layout]]:
    model = make_tiny_model(7, tiny=10)
    layout = Layout.from_tensors(model, chunk_size=64 * 1024)
    store = HolderStore()
    store.add(HeldVersion.publisher(TENANT, MODEL, 1, model, layout))
    with HolderServer(store, allow_all, per_peer=4, max_connections=64) as server:
        yield server, layout


def test_an_evicted_reader_is_told_busy_and_a_served_one_is_kept() -> None:
    """At the per-peer bound of 4, three served connections and one token-less: a newcomer
    evicts the token-less one, which reads a BUSY frame (so the SDK asks again), and the
    served ones keep working."""
    with _holder() as (server, layout):
        get = encode_get(GetRequest(TENANT, MODEL, 1, layout.digest, b"t", (0,), 0))
        served = [socket.create_connection(server.address, timeout=WAIT) for _ in range(3)]
        for sock in served:
            _read_chunk(sock, get)
        idle = socket.create_connection(server.address, timeout=WAIT)
        time.sleep(0.2)  # admitted before the newcomer
        newcomer = socket.create_connection(server.address, timeout=WAIT)
        with idle, newcomer:
            ftype, body = read_frame(idle)
            assert ftype is FrameType.ERROR
            with pytest.raises(TransportError, match="BUSY"):
                raise decode_error(body).error()
            _read_chunk(newcomer, get)
        for sock in served:
            with sock:
                _read_chunk(sock, get)
