"""Shards' parts of the publisher's checksums of a declared layout (docs/design-notes.md,
"Sharded publishes: parts that add up") where a version has more shards than one page of
part keys (80, from one process): the hub adds them up to the sums a whole publish of the
same bytes records, and a layout reader ends on the trainer's bytes. Against a real hub,
etcd and sockets."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import ros
from consistency import ops, parts_sums
from ros.client.layouts import block_set
from ros.hub.server import HubServer
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.declared_records import PARTS_PAGE
from tests.ros.layout_model import CHUNK
from tests.ros.test_declared_layouts import _reference_sums

TENANT = "team-a"


def _sums(client: ros.Hub, model: str, version: int, slices: dict[str, ros.Slice]) -> list[int]:
    """The publisher checksums a ResolveLayout of layout `tp1` answers for `slices`."""
    request = pb.ResolveLayoutRequest(
        model=model, version=version, layout="tp1", block_set=block_set(slices, CHUNK).id
    )
    return list(client._rpc("ResolveLayout", request).publisher_sums)


SHARDS = 80
ROWS = 3  # rows of `w` a shard: 768 bytes, so shards straddle the 4 KiB chunks


def _many_shards_model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(23)
    return {
        "norm": torch.randn(64, generator=g),  # every shard holds it whole (a replica)
        "w": torch.randn(SHARDS * ROWS, 64, generator=g),
    }


def test_a_version_of_more_shards_than_a_page_of_parts_has_the_sums_of_a_whole_publish(
    hub_server: HubServer, connect: Callable[..., ros.Hub], monkeypatch: pytest.MonkeyPatch
) -> None:
    """80 shards (more than `PARTS_PAGE` part keys) of a row-split tensor and a replicated
    one, from 80 clients in one process: the hub reads their parts page by page and adds
    them up to the sums a whole publish of the same bytes records; it keeps them (one
    entry), so a second resolve answers the same. Parts of more than `MAX_PARTS_READ_BYTES`
    add up to none. A `tp1` reader ends on the trainer's bytes."""
    assert SHARDS > PARTS_PAGE
    model = _many_shards_model()
    trainer, rollout = connect(), connect()
    for name in ("many", "whole"):
        trainer.publish(name, 1, model, chunk_size=CHUNK)
    whole = {n: ros.Slice(torch.empty_like(t), (0,) * t.dim(), tuple(t.shape))
             for n, t in model.items()}  # fmt: skip
    for name in ("many", "whole"):
        rollout.declare_layout(name, "tp1", [whole])
    trainer.publish("whole", 2, model, chunk_size=CHUNK)
    for i in range(SHARDS):  # a client a rank, as model-parallel ranks have
        rows = model["w"][i * ROWS : (i + 1) * ROWS].contiguous()
        connect().publish(
            "many", 2, {"norm": model["norm"], "w": rows}, shard=(i, SHARDS),
            placements={"w": (tuple(model["w"].shape), (i * ROWS, 0))}, chunk_size=CHUNK,
        )  # fmt: skip
    kept = hub_server.servicer.hub.parts_sums
    before = len(kept)
    want = _sums(rollout, "whole", 2, whole)
    assert want == _reference_sums(model)
    assert _sums(rollout, "many", 2, whole) == want
    assert len(kept) == before + 1  # added up once, kept
    assert _sums(rollout, "many", 2, whole) == want
    assert len(kept) == before + 1
    assert _sums(rollout, "many", 1, whole) == []  # published before the declaration
    prefix = hub_server.keys.publisher_parts(TENANT, "many", 2)
    first = hub_server.etcd.txn([], [ops.page(prefix, "", PARTS_PAGE)])
    args = (hub_server.etcd, prefix, first.responses[0].response_range, first.revision, None,
            (TENANT, "many", 2), "tp1", block_set(whole, CHUNK).id)  # fmt: skip
    assert parts_sums.block_set_sums(*args) == want  # read page by page, not kept
    monkeypatch.setattr(parts_sums, "MAX_PARTS_READ_BYTES", 1024)
    assert parts_sums.block_set_sums(*args) == []  # past the bound: none (logged)
    got = connect().fetch_slices("many", 2, slices=whole, layout="tp1", timeout=60)
    assert got.served
    for name, tensor in model.items():
        assert torch.equal(whole[name].tensor, tensor), name
