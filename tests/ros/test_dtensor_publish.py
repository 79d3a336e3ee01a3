"""DTensor state dicts publish as shards with their placements derived (issue 35, item 1).

The derivation (`ros.client.dtensors.block`) is checked against torch's own splitting in
process. Then real trainers: 2 or 4 processes in a gloo process group on CPU
(tests/ros/dtensor_rank_proc.py), each rank publishing `model.state_dict()` of a tiny Llama
(transformers' LlamaForCausalLM from a LlamaConfig, hidden 64, 2 layers) sharded by real FSDP2
(`fully_shard`) or real tensor parallelism (`parallelize_module`), or DTensors on a 2 x 2 mesh.
A reader in the test process fetches the version whole (`fetch_slices` of every global
tensor), by other blocks (`fetch_slices`), and shard by shard (`fetch(shard=i)`), and every
byte must equal `get_model_state_dict(model, full_state_dict=True)`, the ranks' own tensors.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

import ros
from ros.client.dtensors import block, chunk
from ros.hub.server import HubServer
from tests.gloo_ranks import launch


def test_chunk_splits_as_torch_chunk_does() -> None:
    for size, parts in itertools.product(range(0, 12), range(1, 6)):
        pieces = torch.arange(size).chunk(parts) if size else ()
        starts = [int(p[0]) for p in pieces]
        for index in range(parts):
            length, start = chunk(size, parts, index)
            if index < len(pieces):
                assert (length, start) == (len(pieces[index]), starts[index]), (size, parts)
            else:  # torch.chunk returns fewer pieces: the rest are empty
                assert length == 0, (size, parts, index)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (3, 2), (2, 2, 2)])
def test_blocks_are_the_ones_torch_computes_for_every_coordinate(
    mesh_shape: tuple[int, ...],
) -> None:
    """Every combination of Shard(0), Shard(1) and Replicate over the mesh's dimensions,
    global shapes even and uneven (and smaller than the mesh): the block of each coordinate
    is torch's (the function DTensor's own checkpointing uses), and the blocks of one
    replica group tile the tensor exactly."""
    kinds = [Shard(0), Shard(1), Replicate()]
    for shape in [(8, 6), (7, 5), (1, 3), (13, 2)]:
        for placements in itertools.product(kinds, repeat=len(mesh_shape)):
            order = _order(placements)
            covered = torch.zeros(shape, dtype=torch.int64)
            for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
                mine = block(shape, mesh_shape, coordinate, order)
                theirs = _compute_local_shape_and_global_offset(
                    shape, mesh_shape, list(coordinate), placements
                )
                local_shape, offsets = mine
                assert local_shape == tuple(theirs[0]), (shape, placements, coordinate)
                if math.prod(local_shape):
                    assert offsets == tuple(theirs[1]), (shape, placements, coordinate)
                    if all(c == 0 for c, p in zip(coordinate, placements, strict=True)
                           if isinstance(p, Replicate)):  # fmt: skip
                        region = tuple(
                            slice(o, o + n) for o, n in zip(offsets, local_shape, strict=True)
                        )
                        covered[region] += 1
            assert bool((covered == 1).all()), (shape, placements)


def _order(placements: tuple[Placement, ...]) -> list[tuple[int, list[int]]]:
    split: dict[int, list[int]] = {}
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            split.setdefault(p.dim, []).append(mesh_dim)
    return sorted(split.items())


# -- real trainers -----------------------------------------------------------------------------


@contextmanager
def ranks(
    hub: HubServer, token: str, model: str, mode: str, world: int, out: Path
) -> Iterator[list[dict[str, Any]]]:
    """`world` rank processes that published `model`@1 (their JSON lines, by rank); they
    serve until the block ends."""
    args = [hub.address, "team-a", token, model, mode, str(out)]
    with launch("tests.ros.dtensor_rank_proc", args, world) as said:
        assert all("exit" not in s for s in said), said
        yield said


def _check_reads(reader: ros.Hub, model: str, out: Path, published: list[dict[str, Any]]) -> None:
    full: dict[str, torch.Tensor] = torch.load(out / "full.pt")
    shards = sorted(int(p["shard"]) for p in published if p["shard"] is not None)
    assert shards == list(range(len(shards)))  # every publishing rank one shard, no gap
    for p in published:  # each rank serves its local tensors' own memory
        assert p["own_memory"], p
        assert all(p["own_memory"].values()), p
    # whole: every global tensor, as one slice
    whole = {
        name: ros.Slice(torch.empty_like(t), [0] * t.dim(), list(t.shape))
        for name, t in full.items()
    }
    reader.fetch_slices(model, 1, slices=whole, timeout=60)
    for name, t in full.items():
        assert torch.equal(whole[name].tensor, t), name
    # other blocks: the middle third of the rows of every 2-D tensor (another layout's rank)
    middle = {}
    for name, t in full.items():
        if t.dim() == 2 and t.shape[0] >= 3:
            lo, hi = t.shape[0] // 3, t.shape[0] - t.shape[0] // 3
            middle[name] = ros.Slice(
                torch.empty(hi - lo, t.shape[1], dtype=t.dtype), [lo, 0], list(t.shape)
            )
    reader.fetch_slices(model, 1, slices=middle, timeout=60)
    for name, s in middle.items():
        lo = int(s.offsets[0])
        assert torch.equal(s.tensor, full[name][lo : lo + s.tensor.shape[0]]), name
    # shard by shard: each shard's tensors are its rank's, and together they hold every
    # element of the model once (a replicated tensor published by one rank only)
    elements = 0
    for index in shards:
        held = reader.fetch(model, 1, shard=index, timeout=60)
        served: dict[str, torch.Tensor] = torch.load(out / f"shard-{index}.pt")
        assert set(held.tensors) == set(served)
        for name, t in held.tensors.items():
            assert torch.equal(t, served[name]), (index, name)
            elements += t.numel()
        held.release(force=True)
    assert elements == sum(t.numel() for t in full.values())


CASES = [("fsdp", 2), ("fsdp", 4), ("tp", 2), ("tp", 4), ("mesh", 4)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("mode", "world"), CASES, ids=[f"{m}-{w}" for m, w in CASES])
def test_every_rank_publishes_its_dtensor_shards_and_readers_get_the_full_state_dict(
    mode: str,
    world: int,
    hub_server: HubServer,
    make_tenant: Callable[[str], str],
    tmp_path: Path,
) -> None:
    token = make_tenant("team-a")
    model = f"llama-{mode}-{world}"
    with ranks(hub_server, token, model, mode, world, tmp_path) as published:
        assert all(int(p["dtensors"]) > 0 for p in published)
        if mode == "mesh":  # a rank of the second replica group owns a block too (spread)
            assert sum(p["shard"] is not None for p in published) == world
        reader = ros.connect(hub_server.address, tenant="team-a", token=token)
        try:
            assert reader.latest(model) == 1
            _check_reads(reader, model, tmp_path, published)
        finally:
            reader.close()
