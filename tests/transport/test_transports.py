"""The `Transport` protocol, its selection and the RDMA descriptor exchange (issue 13, 1).

Parametrised over the transports: the TCP cases run everywhere; the RDMA cases need a
real RDMA device (hardware or Soft-RoCE) and are skipped with the probe's reason where
there is none. Nothing here fakes a device. What needs no device runs on CPU: the choice
of transport per holder and why it fell back, the control channel's messages and every
refusal its server gives over a real socket, and a reader without a device that is handed
an RDMA source anyway (it fails that holder with the reason and reads elsewhere).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import torch

from tensorhub.errors import (
    InvalidArgument,
    NoUsableTransport,
    PermissionDenied,
    TransportError,
    VersionUnavailable,
)
from tests.transport._model import MODEL, TENANT, make_model
from tests.transport._sockets import closed_by_peer
from tests.transport.conftest import StartHolder
from tests.transport.open_verifier import allow_all
from transport.backend import TransportKind
from transport.fetch_state import FetchState
from transport.frames import recv_message, send_message
from transport.layout import Layout
from transport.outcome import ChunkStatus
from transport.planner import Source
from transport.rdma import QpInfo, rdma_available, rdma_unavailable_reason
from transport.rdma.control import (
    MAX_REQUEST_BYTES,
    RdmaControlServer,
    RdmaRequest,
    decode_reply,
    decode_request,
    encode_refusal,
    encode_request,
)
from transport.reader import fetch
from transport.selection import choose
from transport.store import HeldVersion, HolderStore
from transport.topology import Topology
from transport.transports import ReaderBackends
from transport.wire import ErrorCode, Refusal

needs_rdma = pytest.mark.skipif(
    not rdma_available(), reason=f"needs an RDMA device: {rdma_unavailable_reason()}"
)
no_rdma = pytest.mark.skipif(rdma_available(), reason="this machine has a usable RDMA device")
KINDS = [
    pytest.param(TransportKind.TCP, id="tcp"),
    pytest.param(TransportKind.RDMA, id="rdma", marks=[needs_rdma, pytest.mark.rdma]),
]
QP = QpInfo(
    qpn=0x12,
    psn=7,
    lid=1,
    gid="fe80:0000:0000:0000:0202:c9ff:fe00:0001",
    port=1,
    mtu=1024,
)
CHUNK = 64 * 1024


def _deny(tenant: str, model: str, version: int, token: bytes) -> bool:
    return False


@pytest.fixture
def controls() -> Iterator[list[RdmaControlServer]]:
    started: list[RdmaControlServer] = []
    yield started
    for server in started:
        server.stop()


def _serve(
    kind: TransportKind,
    holders: StartHolder,
    controls: list[RdmaControlServer],
    tensors: dict[str, torch.Tensor],
    layout: Layout,
    verifier: object = allow_all,
) -> tuple[HolderStore, Source]:
    """A holder of `tensors` reachable over `kind`: its Source and its store."""
    _, store, tcp = holders(tensors, layout, verifier=verifier)  # type: ignore[arg-type]
    if kind is TransportKind.TCP:
        return store, tcp
    control = RdmaControlServer(store, verifier).start()  # type: ignore[arg-type]
    controls.append(control)
    return store, Source("h0", *control.address, transport=TransportKind.RDMA)


def _dest(layout: Layout) -> HeldVersion:
    return HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate())


@pytest.mark.parametrize("kind", KINDS)
def test_a_fetch_over_each_transport_is_byte_identical(
    kind: TransportKind, holders: StartHolder, controls: list[RdmaControlServer]
) -> None:
    tensors = make_model(1, tiny=300)
    layout = Layout.from_tensors(tensors, chunk_size=CHUNK)
    _, source = _serve(kind, holders, controls, tensors, layout)
    dest = _dest(layout)
    expected = [HeldVersion.publisher(TENANT, MODEL, 1, tensors, layout).checksum(i)
                for i in range(layout.num_chunks)]  # fmt: skip
    stats = fetch(
        TENANT, MODEL, 1, layout, dest, [source], token=b"t",
        deadline=time.monotonic() + 30, me=Topology(), expected=expected,
    )  # fmt: skip
    assert dest.complete
    for name, t in tensors.items():
        assert torch.equal(dest.tensors[name], t), name
    assert stats.transports == {"h0": kind.value}
    assert stats.fallbacks == {}
    total = sum(layout.payload_bytes(i) for i in range(layout.num_chunks))
    assert stats.bytes_per_source == {"h0": total}


@pytest.mark.parametrize("kind", KINDS)
def test_a_channel_gives_one_typed_outcome_per_chunk(
    kind: TransportKind, holders: StartHolder, controls: list[RdmaControlServer]
) -> None:
    tensors = make_model(2, tiny=50)
    layout = Layout.from_tensors(tensors, chunk_size=CHUNK)
    _, source = _serve(kind, holders, controls, tensors, layout)
    dest = _dest(layout)
    f = FetchState(TENANT, MODEL, 1, dest, b"t", time.monotonic() + 30, 5.0)
    channel = ReaderBackends().get(kind).open(f, source, None)
    try:
        outcomes = list(channel.read(list(range(layout.num_chunks))))
    finally:
        channel.close()
    assert [o.status for o in outcomes] == [ChunkStatus.DONE] * layout.num_chunks
    assert [o.index for o in outcomes] == list(range(layout.num_chunks))
    assert dest.complete


@pytest.mark.parametrize("kind", KINDS)
def test_a_refused_token_is_denied_over_each_transport(
    kind: TransportKind, holders: StartHolder, controls: list[RdmaControlServer]
) -> None:
    tensors = make_model(3, tiny=10)
    layout = Layout.from_tensors(tensors, chunk_size=CHUNK)
    _, source = _serve(kind, holders, controls, tensors, layout, verifier=_deny)
    f = FetchState(TENANT, MODEL, 1, _dest(layout), b"t", time.monotonic() + 30, 5.0)
    channel = ReaderBackends().get(kind).open(f, source, None)
    try:
        (out,) = list(channel.read([0, 1]))
    finally:
        channel.close()
    assert out.status is ChunkStatus.DENIED
    with pytest.raises(PermissionDenied):
        fetch(TENANT, MODEL, 1, layout, _dest(layout), [source], token=b"t",
              deadline=time.monotonic() + 10, me=Topology())  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_a_released_version_is_refused_over_each_transport(
    kind: TransportKind, holders: StartHolder, controls: list[RdmaControlServer]
) -> None:
    tensors = make_model(4, tiny=10)
    layout = Layout.from_tensors(tensors, chunk_size=CHUNK)
    store, source = _serve(kind, holders, controls, tensors, layout)
    held = store.get((TENANT, MODEL, 1))
    assert held is not None
    held.release(1.0)  # still in the store, refused: RELEASED
    f = FetchState(TENANT, MODEL, 1, _dest(layout), b"t", time.monotonic() + 30, 5.0)
    channel = ReaderBackends().get(kind).open(f, source, None)
    try:
        (out,) = list(channel.read([0]))
    finally:
        channel.close()
    assert out.status is ChunkStatus.RELEASED
    with pytest.raises(VersionUnavailable):
        fetch(TENANT, MODEL, 1, layout, _dest(layout), [source], token=b"t",
              deadline=time.monotonic() + 10, me=Topology())  # fmt: skip


@needs_rdma
@pytest.mark.rdma
def test_release_returns_only_once_no_rdma_reader_can_read_the_memory(
    holders: StartHolder, controls: list[RdmaControlServer]
) -> None:
    tensors = make_model(7, tiny=20)
    layout = Layout.from_tensors(tensors, chunk_size=CHUNK)
    store, source = _serve(TransportKind.RDMA, holders, controls, tensors, layout)
    held = store.get((TENANT, MODEL, 1))
    assert held is not None
    f = FetchState(TENANT, MODEL, 1, _dest(layout), b"t", time.monotonic() + 30, 5.0)
    channel = ReaderBackends().get(TransportKind.RDMA).open(f, source, None)
    try:
        assert [o.status for o in channel.read([0])] == [ChunkStatus.DONE]
        assert held.reads_in_flight == 1  # the connected reader counts until its QP is gone
        store.release((TENANT, MODEL, 1), 5.0)  # returns once the holder destroyed our QP
        assert held.reads_in_flight == 0
        (out,) = list(channel.read([1]))
        assert out.status is ChunkStatus.FAILED  # the NIC refuses: nothing read after release
    finally:
        channel.close()


# --- selection (CPU) ----------------------------------------------------------------------

BOTH = {"rdma": "10.0.0.1:7001", "tcp": "10.0.0.1:7000"}


def test_a_reader_without_rdma_reads_a_dual_holder_over_tcp_and_says_why() -> None:
    route = choose(BOTH, complete=True, local=[TransportKind.TCP])
    assert (route.kind, route.host, route.port) == (TransportKind.TCP, "10.0.0.1", 7000)
    assert route.fallback.startswith("rdma: no RDMA here")


@no_rdma
def test_the_fallback_reason_is_the_probes() -> None:
    route = choose(BOTH, complete=True)  # this process's own transports
    assert route.kind is TransportKind.TCP
    assert rdma_unavailable_reason() in route.fallback


def test_a_reader_with_rdma_picks_it_first() -> None:
    route = choose(BOTH, complete=True, local=[TransportKind.RDMA, TransportKind.TCP])
    assert (route.kind, route.port, route.fallback) == (TransportKind.RDMA, 7001, "")


@pytest.mark.parametrize(
    ("complete", "tls", "why"),
    [(False, False, "PARTIAL"), (True, True, "TLS is required")],
)
def test_rdma_is_passed_over_for_partial_holders_and_under_tls(
    complete: bool, tls: bool, why: str
) -> None:
    both = [TransportKind.RDMA, TransportKind.TCP]
    route = choose(BOTH, complete=complete, tls=tls, local=both)
    assert route.kind is TransportKind.TCP
    assert why in route.fallback


def test_a_gpu_destination_reads_a_dual_holder_over_tcp_not_dropping_it() -> None:
    """The RDMA channel registers host memory only: a fetch into CUDA tensors must read a
    holder advertising both over TCP (staged), not lose the holder to a failed channel."""
    both = [TransportKind.RDMA, TransportKind.TCP]
    route = choose(BOTH, complete=True, local=both, device_memory=True)
    assert route.kind is TransportKind.TCP
    assert "device memory" in route.fallback
    assert choose(BOTH, complete=True, local=both).kind is TransportKind.RDMA  # the control


def test_an_rdma_only_holder_is_unusable_without_rdma_and_says_why() -> None:
    with pytest.raises(NoUsableTransport, match=r"rdma: no RDMA here.*tcp: not advertised"):
        choose({"rdma": "10.0.0.1:7001"}, complete=True, local=[TransportKind.TCP])


def test_a_malformed_tcp_endpoint_keeps_its_own_message() -> None:
    with pytest.raises(InvalidArgument, match="invalid endpoint"):
        choose({"tcp": "host:"}, complete=True, local=[TransportKind.TCP])


# --- the control channel (CPU: messages and refusals over a real socket) -------------------


def test_a_request_round_trips_and_garbage_is_refused() -> None:
    req = RdmaRequest(TENANT, MODEL, 3, 99, b"\x00tok", QP)
    assert decode_request(encode_request(req)) == req
    for bad in (b"", b"{}", b"[1]", b'{"format":"tensorhub.rdma/1"}', b"\xff" * 10,
                encode_request(req).replace(b'"version":3', b'"version":true')):  # fmt: skip
        with pytest.raises(TransportError):
            decode_request(bad)
    with pytest.raises(TransportError):
        decode_request(b" " * (MAX_REQUEST_BYTES + 1))


def test_a_refusal_round_trips_with_its_typed_code() -> None:
    reply = decode_reply(encode_refusal(ErrorCode.NOT_READY, "partial"))
    assert reply == Refusal(ErrorCode.NOT_READY, int(ErrorCode.NOT_READY), "partial")
    unknown = decode_reply(b'{"format":"tensorhub.rdma/1","error":{"code":999,"message":""}}')
    assert isinstance(unknown, Refusal)
    assert (unknown.code, unknown.raw) == (None, 999)


def _ask(address: tuple[str, int], req: RdmaRequest | bytes) -> object:
    with socket.create_connection(address, timeout=10) as sock:
        send_message(sock, req if isinstance(req, bytes) else encode_request(req))
        return decode_reply(recv_message(sock, 1 << 20))


def _code(reply: object) -> ErrorCode | None:
    assert isinstance(reply, Refusal), reply
    return reply.code


def test_the_control_server_refuses_over_a_real_socket_without_a_device(
    controls: list[RdmaControlServer],
) -> None:
    tensors = make_model(5, tiny=5)
    layout = Layout.from_tensors(tensors, chunk_size=CHUNK)
    store = HolderStore()
    store.add(HeldVersion.publisher(TENANT, MODEL, 1, tensors, layout))
    store.add(HeldVersion.reader(TENANT, MODEL, 2, layout, layout.allocate()))  # PARTIAL

    def verify(tenant: str, model: str, version: int, token: bytes) -> bool:
        return token == b"good"

    server = RdmaControlServer(store, verify).start()
    controls.append(server)
    ok = RdmaRequest(TENANT, MODEL, 1, layout.digest, b"good", QP)
    addr = server.address
    assert _code(_ask(addr, RdmaRequest(TENANT, MODEL, 1, layout.digest, b"bad", QP))) is (
        ErrorCode.DENIED
    )
    assert _code(_ask(addr, RdmaRequest(TENANT, MODEL, 9, layout.digest, b"good", QP))) is (
        ErrorCode.NOT_HELD
    )
    assert _code(_ask(addr, RdmaRequest(TENANT, MODEL, 1, 12345, b"good", QP))) is (
        ErrorCode.LAYOUT_MISMATCH
    )
    assert _code(_ask(addr, RdmaRequest(TENANT, MODEL, 2, layout.digest, b"good", QP))) is (
        ErrorCode.NOT_READY
    )
    assert _code(_ask(addr, b"not json")) is ErrorCode.BAD_FRAME
    if not rdma_available():  # a valid request reaches the device, and says why there is none
        reply = _ask(addr, ok)
        assert _code(reply) is ErrorCode.BAD_REQUEST
        assert isinstance(reply, Refusal)
        assert rdma_unavailable_reason() in reply.message
    held = store.get((TENANT, MODEL, 1))
    assert held is not None
    assert held.reads_in_flight == 0  # nothing left counted


def test_the_control_port_resists_a_slowloris(controls: list[RdmaControlServer]) -> None:
    """The RDMA control port takes connections without a token, so it gets the data port's
    admission rules (issue 12): silent connections are cut at the frame deadline, one
    address is bounded, and when full a silent connection makes room for a real request."""
    tensors = make_model(5, tiny=5)
    layout = Layout.from_tensors(tensors, chunk_size=CHUNK)
    store = HolderStore()
    store.add(HeldVersion.publisher(TENANT, MODEL, 1, tensors, layout))

    def verify(tenant: str, model: str, version: int, token: bytes) -> bool:
        return token == b"good"

    server = RdmaControlServer(
        store, verify, max_connections=6, per_peer=4, frame_timeout=1.0
    ).start()
    controls.append(server)
    host, port = server.address
    silent = [socket.create_connection((host, port), timeout=10) for _ in range(4)]
    try:
        # a fifth from the same address evicts the oldest silent one and is answered (issue
        # 25: refused BUSY before, so silent connections locked their own host out)
        assert _code(_ask((host, port), b"{}")) not in (ErrorCode.BUSY, None)
        other = RdmaRequest(TENANT, MODEL, 1, layout.digest, b"bad", QP)
        with socket.create_connection((host, port), source_address=("127.0.0.2", 0)) as sock:
            send_message(sock, encode_request(other))
            assert _code(decode_reply(recv_message(sock, 1 << 20))) is ErrorCode.DENIED
        # silence is cut at the frame deadline (1 s), not held for good
        assert all(closed_by_peer(s) for s in silent)
    finally:
        for sock in silent:
            sock.close()
    # full of silent connections from several addresses: a real request still gets in
    crowd = [
        socket.create_connection((host, port), source_address=(f"127.0.0.{3 + i % 3}", 0))
        for i in range(6)
    ]
    try:
        with socket.create_connection((host, port), source_address=("127.0.0.9", 0)) as sock:
            send_message(sock, encode_request(other))
            assert _code(decode_reply(recv_message(sock, 1 << 20))) is ErrorCode.DENIED
    finally:
        for sock in crowd:
            sock.close()


@no_rdma
def test_an_rdma_source_on_a_reader_without_a_device_fails_over_to_tcp(
    holders: StartHolder, controls: list[RdmaControlServer]
) -> None:
    tensors = make_model(6, tiny=20)
    layout = Layout.from_tensors(tensors, chunk_size=CHUNK)
    store, tcp = _serve(TransportKind.TCP, holders, controls, tensors, layout)
    control = RdmaControlServer(store, allow_all).start()
    controls.append(control)
    rdma = Source("r0", *control.address, transport=TransportKind.RDMA)
    dest = _dest(layout)
    stats = fetch(TENANT, MODEL, 1, layout, dest, [rdma, tcp], token=b"t",
                  deadline=time.monotonic() + 30, me=Topology())  # fmt: skip
    assert dest.complete
    assert stats.transports == {"r0": "rdma", "h0": "tcp"}
    assert "r0" not in stats.bytes_per_source
    assert rdma_unavailable_reason() in stats.failed_sources["r0"]
