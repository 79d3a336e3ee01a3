"""Same-host CUDA IPC, the holder's control channel and the reader's fallback, on real
sockets without a GPU (issue 15): the refusals before any memory is shared, the lease
protocol (a release waits for the readers' reports and stops new leases; the epoch rule
after a release that gave up; silent and vanished readers), and a reader routed to IPC
that reads the same holder over TCP and says why. The grants here come from an exporter
injected into the holder (`_placeholder_export`) whose handles are placeholders: nothing in
this file opens CUDA memory. Mapping, copying and the IPC event are in test_cuda_ipc.py,
which runs only where there is a GPU.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
import torch

from tensorhub.errors import DeadlineExceeded
from tests.transport._model import MODEL, TENANT, make_model
from tests.transport.open_verifier import allow_all
from transport.backend import TransportKind
from transport.frames import recv_message, send_message
from transport.ipc.cuda import Export
from transport.ipc.fingerprint import (
    local_fingerprint,
)
from transport.ipc.protocol import (
    MAX_GRANT_BYTES,
    Ack,
    IpcGrant,
    IpcRequest,
    Report,
    Storage,
    decode_reply,
)
from transport.ipc.server import IpcControlServer
from transport.layout import Layout
from transport.outcome import FetchStats
from transport.planner import Source
from transport.rdma.seqlock import epoch_ok
from transport.reader import read_round
from transport.server import HolderServer
from transport.store import HeldVersion, HolderStore
from transport.topology import Topology
from transport.transports import ReaderBackends
from transport.wire import ErrorCode, Refusal

ME = local_fingerprint()


# -- the holder's control channel -------------------------------------------------------------


def _placeholder_export(held: HeldVersion, probe: int) -> Export:
    """A grant of placeholder handles for a version in host memory: the lease protocol only.
    Nothing can be mapped from it, and nothing here tries to."""
    storage = Storage(b"\x01" * 64, 4096, 0, b"/torch_1", 8, b"\x02" * 64, True)
    places = tuple((0, 0) for _ in held.layout.tensors)
    grant = IpcGrant(ME, "GPU-1234", held.epoch, b"\x03" * 64, (storage,), places, (0, probe))
    return Export(grant)


@pytest.fixture
def held() -> tuple[HolderStore, HeldVersion]:
    tensors = make_model(3, tiny=20)
    layout = Layout.from_tensors(tensors, chunk_size=64 * 1024)
    store = HolderStore()
    version = HeldVersion.publisher(TENANT, MODEL, 1, tensors, layout)
    store.add(version)
    return store, version


def _server(store: HolderStore, **kwargs: Any) -> IpcControlServer:
    """An `IpcControlServer` over `store` (token b"ok"); `with` starts and stops it."""
    return IpcControlServer(store, _only_ok, **kwargs)


def _ask(server: IpcControlServer, req: IpcRequest) -> tuple[socket.socket, IpcGrant | Refusal]:
    sock = socket.create_connection(server.address, timeout=10)
    send_message(sock, req.encode())
    return sock, decode_reply(recv_message(sock, MAX_GRANT_BYTES))


def _request(version: HeldVersion, token: bytes = b"ok", digest: int | None = None) -> IpcRequest:
    layout = version.layout.digest if digest is None else digest
    return IpcRequest(TENANT, MODEL, version.key[2], layout, token, ME)


def _only_ok(tenant: str, model: str, version: int, token: bytes) -> bool:
    return token == b"ok"


def test_nothing_is_shared_without_a_valid_token(held: tuple[HolderStore, HeldVersion]) -> None:
    store, version = held
    exported: list[int] = []

    def exporter(h: HeldVersion, probe: int) -> Export:
        exported.append(probe)
        return _placeholder_export(h, probe)

    with _server(store, exporter=exporter) as server:
        sock, reply = _ask(server, _request(version, token=b"stolen"))
        sock.close()
    assert isinstance(reply, Refusal)
    assert reply.code is ErrorCode.DENIED
    assert exported == []  # the exporter was never reached


@pytest.mark.parametrize(
    ("case", "code"),
    [("absent", ErrorCode.NOT_HELD), ("layout", ErrorCode.LAYOUT_MISMATCH),
     ("partial", ErrorCode.NOT_READY), ("host", ErrorCode.NOT_READY),
     ("released", ErrorCode.RELEASED)],
)  # fmt: skip
def test_refusals_before_any_memory_is_shared(case: str, code: ErrorCode) -> None:
    tensors = make_model(3, tiny=20)
    layout = Layout.from_tensors(tensors, chunk_size=64 * 1024)
    store = HolderStore()
    if case == "partial":
        version = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate("cpu"))
    else:
        version = HeldVersion.publisher(TENANT, MODEL, 1, tensors, layout)
    if case != "absent":
        store.add(version)
    if case == "released":
        version.release(1.0)
    req = _request(version, digest=1 if case == "layout" else None)
    with _server(store) as server:
        sock, reply = _ask(server, req)
        sock.close()
    assert isinstance(reply, Refusal)
    assert reply.code is code, reply
    if case == "host":  # the default exporter: CUDA only
        assert "in host memory here" in reply.message
        assert reply.message.endswith("read over tcp")


def test_a_garbled_request_is_answered_bad_frame(held: tuple[HolderStore, HeldVersion]) -> None:
    store, _ = held
    with _server(store) as server, socket.create_connection(server.address, timeout=10) as sock:
        send_message(sock, b'{"format":"tensorhub.ipc/1","tenant":7}')
        reply = decode_reply(recv_message(sock, MAX_GRANT_BYTES))
    assert isinstance(reply, Refusal)
    assert reply.code is ErrorCode.BAD_FRAME


def test_a_request_never_finished_is_cut_at_the_frame_deadline(
    held: tuple[HolderStore, HeldVersion],
) -> None:
    store, _ = held
    with _server(store, frame_timeout=0.3) as server:
        sock = socket.create_connection(server.address, timeout=10)
        sock.sendall(b"\x00\x00\x01\x00{")  # 256 bytes announced, one sent
        start = time.monotonic()
        assert sock.recv(1) == b""  # cut by the holder, not by our timeout
        assert time.monotonic() - start < 5
        sock.close()


# -- leases: release waits for reports, stops new leases, and the epoch rule ------------------


def _lease(server: IpcControlServer, version: HeldVersion) -> tuple[socket.socket, IpcGrant]:
    sock, reply = _ask(server, _request(version))
    assert isinstance(reply, IpcGrant), reply
    return sock, reply


def _report(sock: socket.socket, copied: int, final: bool = False) -> Ack:
    send_message(sock, Report(copied, final).encode())
    return Ack.decode(recv_message(sock, 4096))


def _release_in_thread(
    store: HolderStore, version: HeldVersion, timeout: float
) -> tuple[threading.Thread, list[BaseException | None]]:
    result: list[BaseException | None] = []

    def run() -> None:
        try:
            store.release(version.key, timeout)
            result.append(None)
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_a_release_waits_for_the_readers_report_and_refuses_new_leases(
    held: tuple[HolderStore, HeldVersion],
) -> None:
    store, version = held
    with _server(store, exporter=_placeholder_export) as server:
        sock, grant = _lease(server, version)
        assert grant.epoch == 0
        assert grant.probe == (0, version.wsum64(0))  # the holder's own sum of chunk 0
        assert _report(sock, 3) == Ack(0, False)  # a batch kept: nothing changed
        thread, result = _release_in_thread(store, version, timeout=30)
        thread.join(0.5)
        assert thread.is_alive(), "release returned while a lease was out"
        late, reply = _ask(server, _request(version))  # no new lease meanwhile
        late.close()
        assert isinstance(reply, Refusal)
        assert reply.code is ErrorCode.RELEASED
        ack = _report(sock, 2)  # the copy reported in time: kept, and the lease ends
        assert ack == Ack(0, True)
        assert epoch_ok(grant.epoch, ack.epoch, grant.epoch)
        thread.join(10)
        assert result == [None]
        sock.close()
    assert version.epoch % 2 == 1  # from here on the caller may change the memory


def test_a_copy_still_running_when_the_release_gives_up_is_dropped(
    held: tuple[HolderStore, HeldVersion],
) -> None:
    store, version = held
    with _server(store, exporter=_placeholder_export) as server:
        sock, grant = _lease(server, version)
        with pytest.raises(DeadlineExceeded):
            store.release(version.key, 0.3)
        ack = _report(sock, 4)
        sock.close()
    assert ack.released
    assert not epoch_ok(grant.epoch, ack.epoch, grant.epoch)  # the reader drops that batch


def test_a_silent_reader_loses_its_lease_after_lease_idle(
    held: tuple[HolderStore, HeldVersion],
) -> None:
    store, version = held
    with _server(store, exporter=_placeholder_export, lease_idle=0.3) as server:
        sock, _ = _lease(server, version)
        assert server.leases == 1
        assert sock.recv(1) == b""  # the holder ended the lease
        store.release(version.key, 5)  # and nothing holds the release up
        sock.close()


def test_a_reader_that_disconnects_ends_its_lease(held: tuple[HolderStore, HeldVersion]) -> None:
    store, version = held
    with _server(store, exporter=_placeholder_export) as server:
        sock, _ = _lease(server, version)
        sock.close()
        deadline = time.monotonic() + 10
        while server.leases and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.leases == 0
        store.release(version.key, 5)


# -- the reader: falls back to TCP, and says why ----------------------------------------------


def test_a_host_memory_reader_routed_to_ipc_reads_the_same_holder_over_tcp() -> None:
    """A Source routed to IPC whose destination is in host memory: the channel never
    connects to the IPC port, reads every chunk over the holder's TCP port, and the
    fetch's stats say why (also remembered for the next plan)."""
    tensors = make_model(5, tiny=30)
    layout = Layout.from_tensors(tensors, chunk_size=32 * 1024)
    store = HolderStore()
    store.add(HeldVersion.publisher(TENANT, MODEL, 1, tensors, layout))
    with HolderServer(store, allow_all) as tcp, _server(store) as ipc:
        source = Source(
            "h", *ipc.address, transport=TransportKind.IPC, tcp=tcp.address,
        )  # fmt: skip
        dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate("cpu"))
        stats = FetchStats()
        readers = ReaderBackends()
        result = read_round(
            TENANT, MODEL, 1, layout, dest, [source], token=b"ok",
            deadline=time.monotonic() + 30, me=Topology(), stats=stats, readers=readers,
        )  # fmt: skip
        assert ipc.leases == 0
        host, port = ipc.address
    assert result.done
    for name, t in tensors.items():
        assert torch.equal(dest.tensors[name], t), name
    assert result.failures == {}
    assert stats.transports == {"h": "tcp"}
    assert stats.fallbacks == {"h": "ipc: the destination is in host memory"}
    assert stats.bytes_per_source["h"] == sum(t.nbytes for t in layout.tensors)
    assert "the destination is in host memory" in readers.verdicts.known(f"{host}:{port}")
