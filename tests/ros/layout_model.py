"""The model of tests/ros/test_layouts.py: TP-`ranks` blocks of column-split (dim 0) and
row-split (dim 1) weights of a few layers and replicated tensors: a few dozen 4 KiB chunks
and nine blocks per worker, so that a holder can be killed or caught corrupting mid-read
and the blocks it did not give can be told from the ones it did."""

from __future__ import annotations

from collections.abc import Callable

import torch

import ros

OUT, IN = 128, 64
LAYERS = 4
CHUNK = 4096


def global_model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    model = {}
    for i in range(LAYERS):
        model[f"l{i}.qkv.weight"] = torch.randn(OUT, IN, generator=g)
        model[f"l{i}.o.weight"] = torch.randn(IN, OUT, generator=g).to(torch.bfloat16)
    model["norm.weight"] = torch.randn(IN, generator=g)
    model["step"] = torch.tensor(5, dtype=torch.int64)
    return model


def block(name: str, rank: int, ranks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, shape) of rank's block of tensor `name` in a TP-`ranks` layout."""
    full = global_model()[name]
    if name.endswith("qkv.weight"):
        n = OUT // ranks
        return (rank * n, 0), (n, IN)
    if name.endswith("o.weight"):
        n = OUT // ranks
        return (0, rank * n), (IN, n)
    return (0,) * full.dim(), tuple(full.shape)  # replicated


def expected(rank: int, ranks: int) -> dict[str, torch.Tensor]:
    """The global tensors' blocks a TP-`ranks` worker `rank` must end with."""
    out = {}
    for name, tensor in global_model().items():
        offsets, shape = block(name, rank, ranks)
        out[name] = tensor[tuple(slice(o, o + s) for o, s in zip(offsets, shape, strict=True))]
    return out


def slices_for(rank: int, ranks: int) -> tuple[dict[str, torch.Tensor], dict[str, ros.Slice]]:
    """Empty tensors for a worker's blocks, and the slices that fill them."""
    out, slices = {}, {}
    for name, tensor in global_model().items():
        offsets, shape = block(name, rank, ranks)
        out[name] = torch.empty(shape, dtype=tensor.dtype)
        slices[name] = ros.Slice(out[name], offsets, tuple(tensor.shape))
    return out, slices


def block_bytes(rank: int, ranks: int) -> int:
    return sum(t.numel() * t.element_size() for t in expected(rank, ranks).values())


def publish_tp(connect: Callable[..., ros.Hub], ranks: int) -> list[ros.Hub]:
    """TP-`ranks` trainer ranks, each publishing its shard of policy@1."""
    trainers = [connect() for _ in range(ranks)]
    for rank, trainer in enumerate(trainers):
        tensors, placements = {}, {}
        for name, tensor in global_model().items():
            offsets, _ = block(name, rank, ranks)
            tensors[name] = expected(rank, ranks)[name].contiguous()
            if name.endswith(("qkv.weight", "o.weight")):
                placements[name] = (tuple(tensor.shape), offsets)
        trainer.publish(
            "policy", 1, tensors, shard=(rank, ranks), placements=placements, chunk_size=CHUNK
        )
    return trainers
