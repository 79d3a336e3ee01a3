"""CUDA tensors over TCP go through pinned host staging buffers."""

from __future__ import annotations

import time

import pytest
import torch

from tests.transport._model import MODEL, TENANT, make_model
from tests.transport.open_verifier import allow_all
from transport.checksums import WSUM64, wsum64, wsum64_reference
from transport.layout import Layout
from transport.reader import Source, fetch
from transport.server import HolderServer
from transport.store import HeldVersion, HolderStore
from transport.topology import Topology

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA device: torch.cuda.is_available() is False",
    ),
]


def test_cuda_publisher_to_cuda_reader() -> None:
    model = {k: t.cuda() for k, t in make_model(4, tiny=100).items()}
    layout = Layout.from_tensors(model, chunk_size=64 * 1024)
    store = HolderStore()
    store.add(HeldVersion.publisher(TENANT, MODEL, 1, model, layout))
    with HolderServer(store, allow_all) as server:
        dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate("cuda"))
        fetch(
            TENANT,
            MODEL,
            1,
            layout,
            dest,
            [Source("h", *server.address)],
            token=b"",
            deadline=time.monotonic() + 30,
            me=Topology(),
        )
    for name, t in model.items():
        assert torch.equal(dest.tensors[name], t)


def test_wsum64_on_the_device_equals_the_formula() -> None:
    """The publisher's GPU checksum (issue 15): the same torch kernels on a CUDA tensor give
    the value a CPU reader computes (int64 products and sums wrap alike on both)."""
    data = torch.randint(0, 256, (4 * 1024 * 1024 + 5,), dtype=torch.uint8)
    assert wsum64(data.cuda()) == wsum64(data) == wsum64_reference(data.numpy().tobytes())


def test_a_cuda_publisher_sums_on_the_device_and_a_cpu_reader_verifies() -> None:
    model = {k: t.cuda() for k, t in make_model(6, tiny=100).items()}
    layout = Layout.from_tensors(model, chunk_size=64 * 1024)
    held = HeldVersion.publisher(TENANT, MODEL, 1, model, layout)
    expected = [held.wsum64(i) for i in range(layout.num_chunks)]  # kernels on the device
    store = HolderStore()
    store.add(held)
    with HolderServer(store, allow_all) as server:
        dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate())
        fetch(
            TENANT, MODEL, 1, layout, dest, [Source("h", *server.address)], token=b"",
            deadline=time.monotonic() + 30, me=Topology(), expected=expected, checksum=WSUM64,
        )  # fmt: skip
    for name, t in model.items():
        assert torch.equal(dest.tensors[name], t.cpu())
