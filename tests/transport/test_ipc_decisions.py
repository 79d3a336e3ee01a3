"""Same-host CUDA IPC, the decisions made without a GPU (issue 15): whether a reader picks
IPC for a holder, and why not (transport.selection); the host fingerprints that rule
sharing out (a real second IPC namespace made with `unshare`); the control channel's
messages, refused when garbled before any CUDA call; and the copy plan. Nothing here opens
CUDA memory; the lease protocol is in test_ipc_leases.py, mapping and copying in
test_cuda_ipc.py (a GPU only).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.errors import TransportError
from tests.transport._model import MODEL, TENANT
from transport.backend import TransportKind
from transport.ipc.fingerprint import (
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
from transport.ipc.spans import coalesce
from transport.layout import Layout
from transport.selection import choose

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
    route = choose(ENDPOINTS, local=BOTH, verdicts=Verdicts(), **args)
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
    verdicts = Verdicts()  # the reader's own (its client's ReaderBackends)
    verdicts.remember("127.0.0.1:7102", "the holder's GPU x is not visible here")
    route = choose(endpoints, complete=True, local=BOTH, device_memory=True, verdicts=verdicts)
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
