"""Double-buffered CUDA staging on the TCP path (transport/staging.py, copies.py, pipeline.py).

These need a CUDA device and skip without one. The bookkeeping they rely on is tested on the
CPU in test_staging_pipeline.py; here the copies are real: pinned buffers, a copy stream per
device, events.
"""

from __future__ import annotations

import socket
import threading
import time
from functools import partial

import pytest
import torch

from tensorhub.errors import TensorHubError
from tests.transport._model import MODEL, TENANT, make_model
from tests.transport.open_verifier import allow_all
from transport.copies import CudaCopies
from transport.layout import Layout
from transport.pipeline import ScatterBehind
from transport.reader import Source, fetch
from transport.server import ChunkSender, HolderServer, send_chunk
from transport.staging import StagingBuffer
from transport.store import HeldVersion, HolderStore
from transport.topology import Topology
from transport.wire import ChunkHeader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


def _cuda(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: t.cuda() for k, t in model.items()}


def _payloads(held: HeldVersion) -> list[bytes]:
    """Every chunk's payload, read from a host copy of `held`'s tensors."""
    host = {k: t.cpu() for k, t in held.tensors.items()}
    copy = HeldVersion.publisher(*held.key, host, held.layout)
    return [b"".join(bytes(v) for v in copy.source_views(i)) for i in range(held.layout.num_chunks)]


def _fetch(
    layout: Layout, dest: HeldVersion, source: Source, *, parallel: int, stall: float = 5.0
) -> None:
    fetch(
        TENANT, MODEL, 1, layout, dest, [source], token=b"", deadline=time.monotonic() + 60,
        me=Topology(), parallel=parallel, stall_timeout=stall,
    )  # fmt: skip


def _serve(held: HeldVersion, send: ChunkSender = send_chunk) -> HolderServer:
    store = HolderStore()
    store.add(held)
    return HolderServer(store, allow_all, send=send)


@pytest.mark.parametrize("parallel", [1, 4])
def test_cuda_to_cuda_over_loopback_is_byte_exact(parallel: int) -> None:
    model = _cuda(make_model(4, tiny=300))
    layout = Layout.from_tensors(model, chunk_size=64 * 1024)
    assert layout.num_chunks > 8
    with _serve(HeldVersion.publisher(TENANT, MODEL, 1, model, layout)) as server:
        dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate("cuda"))
        _fetch(layout, dest, Source("h", *server.address), parallel=parallel)
    assert dest.complete
    for name, t in model.items():
        assert dest.tensors[name].is_cuda
        assert torch.equal(dest.tensors[name], t)


def test_a_version_of_many_batches_of_chunks() -> None:
    """96 MiB in 256 KiB chunks: 384 chunks, more than one 64 MiB batch per connection."""
    model = _cuda(make_model(7, tiny=500, large=4, large_elems=6_000_000))
    layout = Layout.from_tensors(model, chunk_size=256 * 1024)
    assert layout.num_chunks > 256
    with _serve(HeldVersion.publisher(TENANT, MODEL, 1, model, layout)) as server:
        dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate("cuda"))
        _fetch(layout, dest, Source("h", *server.address), parallel=2)
    for name, t in model.items():
        assert torch.equal(dest.tensors[name], t)


def test_cpu_publisher_to_cuda_reader() -> None:
    model = make_model(5, tiny=200)
    layout = Layout.from_tensors(model, chunk_size=64 * 1024)
    with _serve(HeldVersion.publisher(TENANT, MODEL, 1, model, layout)) as server:
        dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate("cuda"))
        _fetch(layout, dest, Source("h", *server.address), parallel=2)
    for name, t in model.items():
        assert torch.equal(dest.tensors[name].cpu(), t)


class DiesAfter:
    """A holder sender that sends `n` chunks, then breaks off (its process died)."""

    def __init__(self, n: int) -> None:
        self.n, self.sent = n, 0

    def __call__(
        self, conn: socket.socket, header: ChunkHeader, views: list[memoryview], complete: bool
    ) -> None:
        if self.sent >= self.n:
            raise OSError("holder died")
        self.sent += 1
        send_chunk(conn, header, views, complete)


def test_a_holder_dying_mid_batch_leaves_only_copied_chunks_present() -> None:
    model = _cuda(make_model(6, tiny=300))
    layout = Layout.from_tensors(model, chunk_size=64 * 1024)
    n = 5
    assert layout.num_chunks > n + 2
    src = HeldVersion.publisher(TENANT, MODEL, 1, model, layout)
    with _serve(HeldVersion.publisher(TENANT, MODEL, 1, model, layout), DiesAfter(n)) as server:
        dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate("cuda"))
        with pytest.raises(TensorHubError):
            _fetch(layout, dest, Source("h", *server.address), parallel=1)
    present = [i for i in range(layout.num_chunks) if dest.is_present(i)]
    assert present == list(range(n))  # every chunk sent was verified, copied, committed
    want, got = _payloads(src), _payloads(dest)
    for i in present:
        assert got[i] == want[i], f"chunk {i} is present but its bytes are not on the device"


def test_a_partial_cuda_reader_serves_a_second_one_while_it_fetches() -> None:
    """B reads from A while A is still reading from the publisher: A serves a chunk only
    once its host→device copy completed, so B's bytes are exact."""
    model = _cuda(make_model(8, tiny=300, large=3, large_elems=1_000_000))
    layout = Layout.from_tensors(model, chunk_size=64 * 1024)
    a = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate("cuda"))
    b = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate("cuda"))
    with (
        _serve(HeldVersion.publisher(TENANT, MODEL, 1, model, layout)) as publisher,
        _serve(a) as relay,
    ):
        first = threading.Thread(
            target=_fetch, args=(layout, a, Source("pub", *publisher.address)),
            kwargs={"parallel": 2},
        )  # fmt: skip
        first.start()
        _fetch(layout, b, Source("a", *relay.address), parallel=2, stall=10.0)
        first.join(timeout=60)
    for name, t in model.items():
        assert torch.equal(a.tensors[name], t)
        assert torch.equal(b.tensors[name], t)


def test_a_chunk_is_committed_only_after_its_copy_landed_on_the_device() -> None:
    """Each commit checks, on the default stream (which does not wait for the copy stream),
    that the chunk's bytes are already in device memory."""
    size = 64 * 1024 * 1024
    scatter = ScatterBehind(CudaCopies([torch.device("cuda")]), size)
    dest = torch.zeros(4 * size, dtype=torch.uint8, device="cuda")
    data = [torch.randint(0, 255, (size,), dtype=torch.uint8) for _ in range(4)]
    want = [d.cuda() for d in data]
    torch.cuda.synchronize()
    checked: list[int] = []

    def commit(i: int) -> None:
        assert torch.equal(dest[i * size : (i + 1) * size], want[i])
        checked.append(i)

    for i, d in enumerate(data):
        view = scatter.sink(size)
        view[:] = d.numpy().tobytes()
        scatter.issue([dest[i * size : (i + 1) * size]], i, partial(commit, i))
    assert scatter.flush() == [0, 1, 2, 3]
    assert checked == [0, 1, 2, 3]


def test_the_copy_stream_waits_for_the_stream_that_produced_the_tensors() -> None:
    t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]  # a long kernel, then the write
    t.fill_(3)
    staging = StagingBuffer.for_tensors(t.numel(), [t])  # created after: waits for both
    view = staging.gather("t", lambda: [t])
    assert bytes(view) == bytes([3]) * t.numel()
    staging.drain()


def test_precomputed_checksums_of_a_cuda_version_equal_the_host_ones() -> None:
    model = make_model(9, tiny=300)
    layout = Layout.from_tensors(model, chunk_size=64 * 1024)
    on_gpu = HeldVersion.publisher(TENANT, MODEL, 1, _cuda(model), layout)
    on_host = HeldVersion.publisher(TENANT, MODEL, 1, model, layout)
    on_gpu.precompute_checksums()
    assert [on_gpu.checksum(i) for i in range(layout.num_chunks)] == [
        on_host.checksum(i) for i in range(layout.num_chunks)
    ]
