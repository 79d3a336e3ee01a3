"""The backend interface (`transport.backend`) on both sides, without a device.

Every transport's holder side is a `HolderBackend` and its reader side a `ReaderBackend`
(TCP, pyverbs RDMA, same-host CUDA IPC); the RDMA and IPC holder sides start, refuse and
stop on a machine without their hardware, which is what is checked here (their transfers
are tested where a device exists: test_transports.py, test_cuda_ipc.py). A holder backend
hears of each version served and each release through the store (`HolderStore.watch`),
and a release reaches it only after the reads in flight ended (or the wait gave up), with
the epoch odd. Reader backends belong to one client (`ReaderBackends`): two sets share no
verdicts and no device.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from ros.client.serving import Serving
from tensorhub.errors import DeadlineExceeded, InternalError
from tests.transport._model import MODEL, TENANT, make_model
from tests.transport.open_verifier import allow_all
from transport.backend import HolderBackend, ReaderBackend, TransportKind
from transport.ipc.channel import IpcTransport
from transport.ipc.server import IpcControlServer
from transport.layout import Layout
from transport.nixl.loader import unavailable_reason as nixl_unavailable
from transport.rdma.channel import RdmaTransport
from transport.rdma.control import RdmaControlServer
from transport.registry import enabled_transports
from transport.server import HolderServer, send_chunk
from transport.store import HeldVersion, HolderStore
from transport.tcp import TcpTransport
from transport.transports import ReaderBackends


def _held(version: int = 1) -> HeldVersion:
    tensors = make_model(2, tiny=5)
    layout = Layout.from_tensors(tensors, chunk_size=16 * 1024)
    return HeldVersion.publisher(TENANT, MODEL, version, tensors, layout)


def test_every_transport_implements_both_sides() -> None:
    store = HolderStore()
    holders: list[HolderBackend] = [
        HolderServer(store, allow_all),
        RdmaControlServer(store, allow_all),
        IpcControlServer(store, allow_all),
    ]
    readers: list[ReaderBackend] = [
        TcpTransport(),
        RdmaTransport(),
        IpcTransport(ReaderBackends().verdicts),
    ]
    kinds = [TransportKind.TCP, TransportKind.RDMA, TransportKind.IPC]
    assert [b.kind for b in holders] == kinds
    assert [b.kind for b in readers] == kinds
    for backend in holders:  # each listens, is told of a version and its release, stops
        backend.start()
        try:
            assert backend.address[1] > 0
            held = _held()
            backend.register(held)
            held.release(1.0)
            backend.release(held)
        finally:
            backend.stop()
    for reader in readers:
        reader.close()


@pytest.mark.skipif(nixl_unavailable() is not None, reason=f"NIXL: {nixl_unavailable()}")
def test_nixl_implements_both_sides_and_a_client_serves_it_only_when_asked() -> None:
    from transport.nixl import NixlHolder, NixlReader

    store = HolderStore()
    holder: HolderBackend = NixlHolder(store, allow_all)
    reader: ReaderBackend = NixlReader()
    assert holder.kind is reader.kind is TransportKind.NIXL
    holder.start()
    try:
        held = _held()
        holder.register(held)
        held.release(1.0)
        holder.release(held)
    finally:
        holder.stop()
        reader.close()
    for kinds, served in [
        (enabled_transports(), {"tcp"}),  # the default: TCP (no RDMA device, no GPU here)
        (enabled_transports(["nixl"]), {"tcp", "nixl"}),
    ]:
        serving = Serving(
            HolderStore(), allow_all, ("127.0.0.1", 0), advertise=None, tls=None,
            send=send_chunk, kinds=kinds,
        )  # fmt: skip
        serving.start()
        try:
            assert set(serving.endpoints()) == served
        finally:
            serving.stop()


def test_a_holder_backend_hears_of_every_version_and_release_through_the_store() -> None:
    store = HolderStore()
    first = _held(1)
    store.add(first)
    added: list[tuple[int, int]] = []
    released: list[tuple[int, int]] = []
    store.watch(
        lambda h: added.append((h.key[2], h.epoch)), lambda h: released.append((h.key[2], h.epoch))
    )
    assert added == [(1, 0)]  # the versions held already, at once
    second = _held(2)
    store.add(second)
    again = _held(2)
    store.replace(again, timeout=1.0)  # the new copy first, then the old one's release
    store.release((TENANT, MODEL, 1), timeout=1.0)
    assert added == [(1, 0), (2, 0), (2, 0)]
    assert released == [(2, 1), (1, 1)]  # each after its release: the epoch is odd


def test_a_release_reaches_the_backends_after_the_reads_in_flight() -> None:
    """The epoch rule: a release refuses new reads, waits for the running ones, turns the
    epoch odd, and only then do the backends drop the memory; when the wait gives up, the
    backends are told all the same (a one-sided reader then drops its copy by the epoch)."""
    store = HolderStore()
    held = _held()
    store.add(held)
    told: list[float] = []
    store.watch(lambda h: None, lambda h: told.append(time.monotonic()))
    reading, done = threading.Event(), threading.Event()

    def read() -> None:
        with held.reading():
            reading.set()
            time.sleep(0.3)
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert reading.wait(5)
    store.release(held.key, timeout=5.0)
    assert done.is_set()
    assert len(told) == 1
    assert held.epoch & 1

    stuck = _held(2)
    store.add(stuck)
    with stuck.reading(), pytest.raises(DeadlineExceeded):
        store.release(stuck.key, timeout=0.05)
    assert len(told) == 2
    assert stuck.epoch & 1


def test_reader_backends_belong_to_their_client() -> None:
    """Two clients' reader backends share nothing: not the verdicts of failed IPC holders,
    not the RDMA port (opened by the first channel that needs it, closed with the client)."""
    ours, theirs = ReaderBackends(), ReaderBackends()
    ours.verdicts.remember("127.0.0.1:7102", "mapping failed")
    assert theirs.verdicts.known("127.0.0.1:7102") == ""
    ipc = ours.get(TransportKind.IPC)
    assert isinstance(ipc, IpcTransport)
    assert ipc.verdicts is ours.verdicts
    assert ours.get(TransportKind.TCP) is ours.get(TransportKind.TCP)

    opened: list[_Port] = []

    def opener() -> Any:
        opened.append(_Port())
        return opened[-1]

    rdma = RdmaTransport(opener)
    assert rdma.device() is rdma.device()  # opened once
    rdma.close()
    assert len(opened) == 1
    assert opened[0].closed
    ours.close()
    theirs.close()


class _Port:
    """Stands in for an opened `RdmaDevice` (only its close is looked at)."""

    closed = False

    def close(self) -> None:
        self.closed = True


def test_building_a_holder_record_starts_nothing() -> None:
    """Until a publish or a fetch that holds a version starts it, a client serves nothing:
    asking for the endpoints a record would name is an error, not a side effect."""
    serving = Serving(
        HolderStore(), allow_all, ("127.0.0.1", 0), advertise=None, tls=None, send=send_chunk
    )
    assert serving.backends == []
    with pytest.raises(InternalError):
        serving.endpoints()
    serving.start()
    try:
        assert next(b.kind for b in serving.backends) is TransportKind.TCP
        assert set(serving.endpoints()) >= {"tcp"}
    finally:
        serving.stop()
