"""Same-host CUDA IPC, the parts that run without a GPU (issue 15).

What runs here, on real sockets and real processes: the eligibility decisions (selection
and host fingerprints, a real second IPC namespace made with `unshare`), the control
channel's refusals before any memory is shared, the lease protocol (release waits for the
readers' reports, stops new leases, and the epoch rule), the copy plan, and the reader's
fallback to TCP with its reason. The grant's handles here are placeholders from an
exporter injected into the holder (`_placeholder_export`): nothing in this file opens CUDA
memory. Mapping, copying and the IPC event are in tests/transport/test_cuda_ipc.py, which
runs only where there is a GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.errors import DeadlineExceeded, TransportError
from tests.transport._model import MODEL, TENANT, make_model
from transport.backend import TransportKind
from transport.frames import recv_message, send_message
from transport.ipc.cuda import Export
from transport.ipc.fingerprint import (
    VERDICTS,
    HostFingerprint,
    Verdicts,
    local_fingerprint,
    mismatch,
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
from transport.ipc.spans import coalesce
from transport.layout import Layout
from transport.outcome import FetchStats
from transport.planner import Source
from transport.rdma.seqlock import epoch_ok
from transport.reader import read_round
from transport.selection import choose
from transport.server import HolderServer, allow_all
from transport.store import HeldVersion, HolderStore
from transport.topology import Topology
from transport.wire import ErrorCode, Refusal

ME = local_fingerprint()
BOTH = [TransportKind.IPC, TransportKind.TCP]  # a reader that has CUDA (declared)
ENDPOINTS = {"tcp": "127.0.0.1:7001", "ipc": "127.0.0.1:7002"}


# -- eligibility decided before connecting (transport.selection) ------------------------


def test_a_cuda_destination_reads_a_complete_holder_over_ipc_with_tcp_to_fall_back_on() -> None:
    route = choose(ENDPOINTS, complete=True, local=BOTH, device_memory=True)
    assert (route.kind, route.port, route.tcp) == (TransportKind.IPC, 7002, ("127.0.0.1", 7001))


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"device_memory": False}, "ipc: the destination is host memory"),
        ({"complete": False}, "ipc: the holder is PARTIAL"),
        ({"tls": True}, "ipc: TLS is required and the IPC control channel is not encrypted"),
    ],
)
def test_ipc_is_passed_over_with_the_reason(kwargs: dict[str, bool], why: str) -> None:
    args = {"complete": True, "device_memory": True, "tls": False, **kwargs}
    route = choose(ENDPOINTS, local=BOTH, **args)
    assert route.kind is TransportKind.TCP
    assert route.port == 7001
    assert route.fallback.startswith(why), route.fallback


def test_a_process_without_cuda_says_so_when_it_passes_ipc_over() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the no-CUDA reason cannot show")
    route = choose(ENDPOINTS, complete=True, device_memory=True)
    assert route.kind is TransportKind.TCP
    assert "ipc: no CUDA device in this process" in route.fallback


def test_a_holder_whose_ipc_failed_lately_is_read_over_tcp_at_once() -> None:
    endpoints = {"tcp": "127.0.0.1:7101", "ipc": "127.0.0.1:7102"}
    VERDICTS.remember("127.0.0.1:7102", "the holder's GPU x is not visible here")
    route = choose(endpoints, complete=True, local=BOTH, device_memory=True)
    assert route.kind is TransportKind.TCP
    assert "failed with this holder lately: the holder's GPU x is not visible" in route.fallback


def test_verdicts_expire() -> None:
    verdicts = Verdicts(ttl=0.05)
    verdicts.remember("h:1", "why")
    assert verdicts.known("h:1") == "why"
    time.sleep(0.1)
    assert verdicts.known("h:1") == ""


# -- host fingerprints ------------------------------------------------------------------


def test_this_process_has_a_boot_id_and_an_ipc_namespace() -> None:
    assert len(ME.boot_id) == 36
    assert ME.ipc_namespace.startswith("ipc:[")
    assert ME.pid == os.getpid()
    assert HostFingerprint.from_json(json.loads(json.dumps(ME.to_json()))) == ME


def test_mismatch_names_what_differs() -> None:
    cuda_me = HostFingerprint(ME.boot_id, ME.ipc_namespace, "12080", 100)
    holder = HostFingerprint(ME.boot_id, ME.ipc_namespace, "12080", 200)
    assert mismatch(cuda_me, holder) == ""
    assert "the holder is this process" in mismatch(cuda_me, cuda_me)
    other = HostFingerprint("0" * 36, ME.ipc_namespace, "12080", 200)
    assert "another machine" in mismatch(cuda_me, other)
    driver = HostFingerprint(ME.boot_id, ME.ipc_namespace, "12040", 200)
    assert "another CUDA driver (12040 vs 12080)" in mismatch(cuda_me, driver)
    no_cuda = HostFingerprint(ME.boot_id, ME.ipc_namespace, "", 200)
    assert mismatch(no_cuda, cuda_me) == "no CUDA driver in this process"
    assert mismatch(cuda_me, no_cuda) == "no CUDA driver in the holder"


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_a_process_in_another_ipc_namespace_is_told_apart() -> None:
    """A real second IPC namespace (what a container without --ipc=host has)."""
    code = (
        "import json; from transport.ipc.fingerprint import local_fingerprint;"
        "print(json.dumps(local_fingerprint().to_json()))"
    )
    run = subprocess.run(
        ["unshare", "--ipc", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if run.returncode != 0:
        pytest.skip(f"cannot create an IPC namespace here: {run.stderr.strip()[-200:]}")
    theirs = HostFingerprint.from_json(json.loads(run.stdout))
    assert theirs.boot_id == ME.boot_id
    assert theirs.ipc_namespace != ME.ipc_namespace
    assert theirs.pid != ME.pid
    cuda_me = HostFingerprint(ME.boot_id, ME.ipc_namespace, "1", ME.pid)
    why = mismatch(cuda_me, HostFingerprint(theirs.boot_id, theirs.ipc_namespace, "1", theirs.pid))
    assert "another IPC namespace (containers without a shared --ipc)" in why


# -- messages -----------------------------------------------------------------------------


def _grant(places: tuple[tuple[int, int], ...] = ((0, 0),), epoch: int = 0) -> IpcGrant:
    storage = Storage(b"\x01" * 64, 4096, 0, b"/torch_1", 8, b"\x02" * 64, True)
    return IpcGrant(ME, "GPU-1234", epoch, b"\x03" * 64, (storage,), places, (0, 99))


def test_messages_round_trip() -> None:
    req = IpcRequest(TENANT, MODEL, 3, 77, b"tok", ME)
    assert IpcRequest.decode(req.encode()) == req
    grant = _grant(((0, 0), (0, 512)))
    assert decode_reply(grant.encode()) == grant
    assert Report.decode(Report(5, final=True).encode()) == Report(5, True)
    assert Ack.decode(Ack(1, True).encode()) == Ack(1, True)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(epoch=True),  # a JSON bool is not an integer
        lambda d: d.update(epoch=-1),
        lambda d: d.update(places=[[1, 0]]),  # names a storage the grant does not have
        lambda d: d.update(places=[[0]]),
        lambda d: d.update(event="zz"),
        lambda d: d.update(event="ab" * 600),
        lambda d: d.update(storages=[["00", 1, 2, "00", 3, "00", 1]]),  # sync must be a bool
        lambda d: d.pop("probe"),
        lambda d: d.update(host={"boot": 1}),
        lambda d: d.update(format="tensorhub.rdma/1"),
    ],
)
def test_a_garbled_grant_is_refused_before_any_cuda_call(mutate: object) -> None:
    doc = json.loads(_grant().encode())
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(TransportError):
        decode_reply(json.dumps(doc).encode())


def test_an_oversized_grant_is_refused_unparsed() -> None:
    with pytest.raises(TransportError, match="over"):
        decode_reply(b" " * (MAX_GRANT_BYTES + 1))


# -- the copy plan --------------------------------------------------------------------------


def test_consecutive_chunks_of_one_tensor_are_one_copy() -> None:
    layout = Layout.from_tensors({"w": torch.zeros(1 << 20)}, chunk_size=64 * 1024)
    assert coalesce(layout, range(8, 40)) == [(0, 8 * 65536, 32 * 65536)]
    assert coalesce(layout, [3, 1, 2, 9]) == [(0, 65536, 3 * 65536), (0, 9 * 65536, 65536)]


def test_a_chunk_of_many_small_tensors_is_one_copy_per_tensor() -> None:
    layout = Layout.from_tensors({f"t{i}": torch.zeros(10) for i in range(50)}, chunk_size=4096)
    spans = coalesce(layout, [0])
    assert [s[0] for s in spans] == list(range(50))
    assert all(length == 40 for _, _, length in spans)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 20000), min_size=1, max_size=12),
    chunk_kib=st.sampled_from([4, 8]),
    pick=st.sets(st.integers(0, 60), max_size=30),
)
def test_the_spans_copy_exactly_the_chunks_asked_for(
    sizes: list[int], chunk_kib: int, pick: set[int]
) -> None:
    """Applied with plain copies, the spans of a batch reproduce each chunk's bytes and
    touch no byte of any other chunk."""
    src = {f"t{i}": torch.randint(0, 256, (n,), dtype=torch.uint8) for i, n in enumerate(sizes)}
    layout = Layout.from_tensors(src, chunk_size=chunk_kib * 1024)
    chunks = {c for c in pick if c < layout.num_chunks}
    srcs = [src[s.name] for s in layout.tensors]
    dsts = [torch.zeros_like(t) for t in srcs]
    for tensor, start, length in coalesce(layout, chunks):
        dsts[tensor][start : start + length].copy_(srcs[tensor][start : start + length])
    for index in range(layout.num_chunks):
        for seg in layout.segments(index):
            got = dsts[seg.tensor][seg.start : seg.start + seg.length]
            want = srcs[seg.tensor][seg.start : seg.start + seg.length]
            if index in chunks:
                assert torch.equal(got, want)
            else:
                assert not got.any()


# -- the holder's control channel -------------------------------------------------------------


def _placeholder_export(held: HeldVersion, probe: int) -> Export:
    """A grant of placeholder handles for a version in host memory: the lease protocol only.
    Nothing can be mapped from it, and nothing here tries to."""
    places = tuple((0, 0) for _ in held.layout.tensors)
    grant = _grant(places, epoch=held.epoch)
    return Export(IpcGrant(grant.host, grant.device_uuid, grant.epoch, grant.event,
                           grant.storages, places, (0, probe)))  # fmt: skip


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
        result = read_round(
            TENANT, MODEL, 1, layout, dest, [source], token=b"ok",
            deadline=time.monotonic() + 30, me=Topology(), stats=stats,
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
    assert "the destination is in host memory" in VERDICTS.known(f"{host}:{port}")
