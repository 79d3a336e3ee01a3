"""CUDA tensors over TCP go through pinned host staging buffers."""

from __future__ import annotations

import time

import pytest
import torch

from tests.transport._model import MODEL, TENANT, make_model
from transport.layout import Layout
from transport.reader import Source, fetch
from transport.server import HolderServer, allow_all
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
