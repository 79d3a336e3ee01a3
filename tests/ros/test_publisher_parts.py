"""Shards' parts of the publisher's checksums of a declared layout (docs/design-notes.md,
"Sharded publishes: parts that add up") where a version's shards come through a process
group's one call (`publish(..., group=PG)`: 2 gloo ranks as real processes,
tests/ros/group_rank_proc.py) and where a version has more shards than one page of part
keys (80, from one process): the hub adds them up to the sums a whole publish of the same
bytes records, and a layout reader ends on bytes checked against them. Ranks that read two
revisions of the declarations make a version without sums, never with wrong ones. Against a
real hub, etcd and sockets."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch

import ros
from consistency import ops, parts_sums
from ros.client.layouts import block_set
from ros.hub.server import HubServer
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.declared_records import PARTS_PAGE
from tests.gloo_ranks import launch
from tests.ros.group_rank_proc import whole_slices
from tests.ros.layout_model import CHUNK, global_model
from tests.ros.test_declared_layouts import _reference_sums

TENANT = "team-a"


def _sums(client: ros.Hub, model: str, version: int, slices: dict[str, ros.Slice]) -> list[int]:
    """The publisher checksums a ResolveLayout of layout `tp1` answers for `slices`."""
    request = pb.ResolveLayoutRequest(
        model=model, version=version, layout="tp1", block_set=block_set(slices, CHUNK).id
    )
    return list(client._rpc("ResolveLayout", request).publisher_sums)


def _read_twice(clients: Callable[[], ros.Hub], model: str, want: dict[str, torch.Tensor]) -> None:
    """A first `tp1` reader of model@2 reads it from the trainer's shards, a second one
    every byte from the first (checked against the publisher's sums); both end on `want`."""
    first, second = clients(), clients()
    outs = []
    for reader in (first, second):
        slices = whole_slices()
        got = reader.fetch_slices(model, 2, slices=slices, layout="tp1", timeout=60)
        outs.append((got, slices))
    assert outs[0][0].served
    assert set(outs[1][0].bytes_per_source) == {first.holder_name}
    for _, slices in outs:
        for name, tensor in want.items():
            assert torch.equal(slices[name].tensor, tensor), name


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["layout", "skewed"])
def test_a_group_publishes_its_ranks_parts_and_a_layout_reader_gets_the_publishers_sums(
    mode: str, hub_server: HubServer, make_tenant: Callable[[str], str]
) -> None:
    """TP-2 ranks publish policy@2 through their gloo group's one call, with `tp1` (each
    tensor whole) declared after policy@1: the hub adds their parts up to the wsum64 of the
    whole model's chunks, and two `tp1` readers end on the trainer's bytes. `skewed`: rank 1
    declares `tp1` again after rank 0 read the declarations, so their parts name two
    revisions: no sums, and the readers take the reader-derived path to the same bytes."""
    token = make_tenant(TENANT)
    opened: list[ros.Hub] = []

    def clients() -> ros.Hub:
        opened.append(ros.connect(hub_server.address, tenant=TENANT, token=token))
        return opened[-1]

    model = f"group-parts-{mode}"
    try:
        trainer, rollout = clients(), clients()
        trainer.publish(model, 1, global_model(), chunk_size=CHUNK)
        rollout.declare_layout(model, "tp1", [whole_slices()])
        args = [hub_server.address, TENANT, token, model, mode]
        with launch("tests.ros.group_rank_proc", args, 2) as ranks:
            assert [r.get("error") for r in ranks] == [None, None], ranks
            assert all(r["visible"] for r in ranks), ranks
            prefix = hub_server.keys.publisher_parts(TENANT, model, 2)
            written = hub_server.etcd.range(prefix, prefix=True).kvs
            revisions = [json.loads(kv.value)["revision"] for kv in written]
            assert len(revisions) == 2  # each rank's shard wrote its parts
            sums = _sums(rollout, model, 2, whole_slices())
            if mode == "layout":
                assert len(set(revisions)) == 1
                assert sums == _reference_sums(global_model())
            else:
                assert len(set(revisions)) == 2
                assert sums == []  # two revisions: none, never wrong ones
            _read_twice(clients, model, global_model())
    finally:
        for client in opened:
            client.close()


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
