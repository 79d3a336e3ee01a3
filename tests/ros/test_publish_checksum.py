"""A version's chunk checksum algorithm, end to end through a real hub (issue 15, the part
that runs on CPU): `publish(checksum=...)` names it in the manifest, readers verify either
kind, and versions of both kinds coexist. On a GPU the default for CUDA tensors is wsum64;
that case is in tests/transport/test_cuda.py and needs a device."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import ros
from tensorhub.errors import InvalidArgument
from tests.ros.helpers import digest, make_model
from transport.checksums import WSUM64, wsum64_reference
from transport.layout import Layout


def test_versions_of_both_kinds_coexist_and_readers_verify_either(
    connect: Callable[..., ros.Hub],
) -> None:
    trainer, reader = connect(), connect()
    v1, v2 = make_model(1), make_model(2)
    trainer.publish("policy", 1, v1, chunk_size=4096)  # host tensors: xxh3-64 by default
    trainer.publish("policy", 2, v2, chunk_size=4096, checksum=WSUM64)
    assert reader.inspect("policy", 1).manifest.checksum == ""  # reads as xxh3-64
    manifest = reader.inspect("policy", 2).manifest
    assert manifest.checksum == WSUM64
    layout = Layout.from_tensors(v2, chunk_size=4096)
    # the manifest's sums are the formula over each chunk's bytes (tensors packed as laid out)
    packed = bytearray(layout.total_bytes)
    for spec, tensor in zip(layout.tensors, v2.values(), strict=True):
        raw = tensor.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        packed[spec.offset : spec.offset + len(raw)] = raw
    sums = [
        wsum64_reference(bytes(packed[i * 4096 : i * 4096 + layout.payload_bytes(i)]))
        for i in range(layout.num_chunks)
    ]
    assert list(manifest.chunk_xxh3) == sums
    for version, weights in ((1, v1), (2, v2)):
        held = reader.fetch("policy", version, timeout=30)
        assert digest(held.tensors) == digest(weights)
        held.release()


def test_an_unknown_checksum_is_refused_before_anything_is_published(
    connect: Callable[..., ros.Hub],
) -> None:
    trainer = connect()
    with pytest.raises(InvalidArgument, match="checksum 'crc32'"):
        trainer.publish("policy", 1, make_model(1), checksum="crc32")
    assert trainer.latest("policy") == 0


def test_fetch_slices_verifies_wsum64_shards(connect: Callable[..., ros.Hub]) -> None:
    ranks = [connect(), connect()]
    full = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    for rank, client in enumerate(ranks):
        part = full[rank * 32 : (rank + 1) * 32].contiguous()
        client.publish(
            "policy", 1, {"w": part}, shard=(rank, 2), placements={"w": ((64, 32), (rank * 32, 0))},
            chunk_size=4096, checksum=WSUM64,
        )  # fmt: skip
    rows = torch.empty(40, 32)
    got = connect().fetch_slices(
        "policy", 1, slices={"w": ros.Slice(rows, (12, 0), (64, 32))}, timeout=30
    )
    assert torch.equal(rows, full[12:52])
    assert got.chunks > 0
