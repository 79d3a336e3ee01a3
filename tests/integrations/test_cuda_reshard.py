"""Model-parallel weights in GPU memory (issue 15): TP-2 trainer ranks publish CUDA shards
with placements; TP-4 rollout ranks read only their blocks (`fetch_slices`) into CUDA
tensors they allocated, a TP-1 rollout assembles the whole model on the GPU, and a TP-2
rollout fetches its own shard (`fetch(shard=i)`) into GPU memory.

The model is one tensor-parallel MLP: `up` is column-parallel (weight and bias split on
dim 0), `down` row-parallel (weight split on dim 1, a non-contiguous block of the global
tensor; bias replicated, published whole by every rank)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional

import ros

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]

D, H = 128, 512  # model and hidden width: up is Linear(D, H), down is Linear(H, D)
CHUNK = 4096  # small chunks: every tensor spans several, and blocks start inside chunks
SPLIT = {"up.weight": 0, "up.bias": 0, "down.weight": 1}  # split dim; down.bias replicated


def global_model() -> dict[str, torch.Tensor]:
    """The whole model, in GPU memory (down in bfloat16: a 2-byte dtype through the path)."""
    g = torch.Generator().manual_seed(15)
    host = {
        "up.weight": torch.randn(H, D, generator=g),
        "up.bias": torch.randn(H, generator=g),
        "down.weight": torch.randn(D, H, generator=g).to(torch.bfloat16),
        "down.bias": torch.randn(D, generator=g).to(torch.bfloat16),
    }
    return {name: t.cuda() for name, t in host.items()}


def block(name: str, shape: tuple[int, ...], rank: int, ranks: int) -> tuple[slice, ...]:
    """The index of rank's block of global tensor `name` (of `shape`) in TP-`ranks`."""
    index = [slice(0, n) for n in shape]
    dim = SPLIT.get(name)
    if dim is not None:
        n = shape[dim] // ranks
        index[dim] = slice(rank * n, (rank + 1) * n)
    return tuple(index)


def offsets_of(index: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(int(s.start) for s in index)


def publish_tp2(
    connect: Callable[..., ros.Hub],
) -> tuple[list[ros.Hub], list[dict[str, torch.Tensor]]]:
    """Two trainer ranks publish their CUDA shards of version 1; their clients and shards."""
    full = global_model()
    trainers, shards = [connect(), connect()], []
    for rank, trainer in enumerate(trainers):
        tensors, placements = {}, {}
        for name, tensor in full.items():
            index = block(name, tuple(tensor.shape), rank, 2)
            # down.weight's block is a strided view: publish makes its contiguous copy (on
            # the device); the others are contiguous already
            tensors[name] = tensor[index] if name == "down.weight" else tensor[index].clone()
            if name in SPLIT:
                placements[name] = (tuple(tensor.shape), offsets_of(index))
        pub = trainer.publish(
            "mlp", 1, tensors, shard=(rank, 2), placements=placements, chunk_size=CHUNK
        )
        assert pub.shard == rank
        shards.append({name: t.contiguous() for name, t in tensors.items()})
    return trainers, shards


def shard_bytes(shard: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in shard.values())


def read_tp(
    reader: ros.Hub, full: dict[str, torch.Tensor], rank: int, ranks: int, device: str
) -> tuple[dict[str, torch.Tensor], ros.SliceFetch]:
    """Rank `rank` of a TP-`ranks` rollout reads its blocks of the global tensors `full`
    into tensors it allocated on `device`, filled with a sentinel (an element left
    unwritten shows), and each is filled in place."""
    out, slices = {}, {}
    for name, tensor in full.items():
        index = block(name, tuple(tensor.shape), rank, ranks)
        shape = tuple(s.stop - s.start for s in index)
        out[name] = torch.full(shape, -7.0, dtype=tensor.dtype, device=device)
        slices[name] = ros.Slice(out[name], offsets_of(index), tuple(tensor.shape))
    pointers = {name: t.data_ptr() for name, t in out.items()}
    got = reader.fetch_slices("mlp", 1, slices=slices, timeout=60)
    assert got.version == 1
    for name, tensor in out.items():
        assert tensor.data_ptr() == pointers[name], f"{name}: not filled in place"
        want = full[name][block(name, tuple(full[name].shape), rank, ranks)]
        assert torch.equal(tensor, want.to(device)), (name, rank, ranks)
    return out, got


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_tp4_rollout_ranks_read_their_blocks_of_cuda_shards(
    connect: Callable[..., ros.Hub], device: str
) -> None:
    """Four rollout ranks (one client each) read only their TP-4 blocks of the TP-2 CUDA
    shards: into GPU memory (staged on the device, one source shard at a time), and into
    host memory (a CPU reader of a GPU publisher's wsum64 shards: staged on the host)."""
    _, shards = publish_tp2(connect)
    full = global_model()
    rollouts = [connect() for _ in range(4)]
    smallest = min(shard_bytes(s) for s in shards)
    largest = max(shard_bytes(s) for s in shards)
    for rank, rollout in enumerate(rollouts):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        got, stats = read_tp(rollout, full, rank, 4, device)
        peak = torch.cuda.max_memory_allocated() - before
        after = torch.cuda.memory_allocated() - before
        mine = shard_bytes(got) if device == "cuda" else 0  # the rank's own blocks
        slack = 512 * len(got)  # the caching allocator rounds each block up to 512 bytes
        # a TP-4 rank reads its half of each source shard's split tensors, not the model
        assert stats.total_bytes < 0.75 * sum(shard_bytes(s) for s in shards), rank
        if device == "cuda":
            # each source shard's staging copy (its whole layout) was on the GPU, one at a
            # time, and none is left once fetch_slices returned
            assert mine + smallest <= peak < mine + 1.5 * largest, (rank, peak, mine)
        else:
            assert peak < smallest, (rank, peak)  # host staging: no shard on the GPU
        assert mine <= after <= mine + slack, (rank, after, mine)


def test_a_tp1_rollout_assembles_the_whole_model_on_the_gpu(
    connect: Callable[..., ros.Hub],
) -> None:
    """One TP-1 rollout fills its own CUDA nn.Linear parameters with both shards' blocks,
    and the layers compute what the global weights compute (the same kernels)."""
    publish_tp2(connect)
    full = global_model()
    up, down = nn.Linear(D, H).cuda(), nn.Linear(H, D).cuda().to(torch.bfloat16)
    params = {"up.weight": up.weight, "up.bias": up.bias}
    params.update({"down.weight": down.weight, "down.bias": down.bias})
    slices = {
        name: ros.Slice(p, (0,) * p.dim(), tuple(full[name].shape)) for name, p in params.items()
    }
    got = connect().fetch_slices("mlp", 1, slices=slices, timeout=60)
    assert got.total_bytes >= sum(t.numel() * t.element_size() for t in full.values())
    for name, p in params.items():
        assert p.is_cuda, name
        assert p.requires_grad, name  # still the module's parameter
        assert torch.equal(p.detach(), full[name]), name
    x = torch.randn(8, D, device="cuda")
    with torch.no_grad():
        got_out = down(functional.gelu(up(x)).to(torch.bfloat16))
        hidden = functional.gelu(functional.linear(x, full["up.weight"], full["up.bias"]))
        want_out = functional.linear(
            hidden.to(torch.bfloat16), full["down.weight"], full["down.bias"]
        )
    assert torch.equal(got_out, want_out)


def test_slices_that_are_strided_views_of_gpu_buffers(connect: Callable[..., ros.Hub]) -> None:
    """A rollout that keeps its TP-4 blocks in larger preallocated CUDA buffers (a fused
    layout): each slice is a non-contiguous view, up.weight's even a transposed one, and
    fetch_slices writes through the views, leaving the rest of each buffer untouched."""
    publish_tp2(connect)
    full = global_model()
    rank, rows = 1, H // 4
    fused = torch.full((D, 2 * rows), 5.0, device="cuda")
    up = fused[:, rows:].T  # [H/4, D], strides (1, 2 * H/4)
    fused16 = torch.zeros((D, 2 * rows), dtype=torch.bfloat16, device="cuda")
    down = fused16[:, rows:]  # [D, H/4], row stride 2 * H/4
    assert not up.is_contiguous()
    assert not down.is_contiguous()
    slices = {
        "up.weight": ros.Slice(up, (rank * rows, 0), (H, D)),
        "down.weight": ros.Slice(down, (0, rank * rows), (D, H)),
    }
    connect().fetch_slices("mlp", 1, slices=slices, timeout=60)
    assert torch.equal(up, full["up.weight"][rank * rows : (rank + 1) * rows])
    assert torch.equal(down, full["down.weight"][:, rank * rows : (rank + 1) * rows])
    assert torch.equal(fused[:, :rows], torch.full((D, rows), 5.0, device="cuda"))
    assert torch.equal(fused16[:, :rows], torch.zeros_like(fused16[:, :rows]))


def test_a_tp2_rollout_fetches_its_own_shard_into_gpu_memory(
    connect: Callable[..., ros.Hub],
) -> None:
    """`fetch(shard=i)` into CUDA tensors: the layout-preserving case. The rollout then holds
    shard i in GPU memory and serves it: with shard 0's trainer stopped, a TP-4 rank's
    fetch_slices reads shard 0 from that rollout's GPU memory."""
    trainers, shards = publish_tp2(connect)
    rollouts = [connect(), connect()]
    for rank, rollout in enumerate(rollouts):
        into = {name: torch.empty_like(t) for name, t in shards[rank].items()}
        held = rollout.fetch("mlp", 1, shard=rank, into=into, timeout=60)
        assert held.shard == rank
        for name, tensor in into.items():
            assert held.tensors[name] is tensor, name
            assert tensor.is_cuda, name
            assert torch.equal(tensor, shards[rank][name]), (name, rank)
    trainers[0]._serving.server.stop()  # shard 0's publisher stops serving; its record stays
    _, stats = read_tp(connect(), global_model(), 0, 4, "cuda")  # TP-4 rank 0: shard 0 only
    assert trainers[0].holder_name not in stats.bytes_per_source
    assert stats.bytes_per_source.get(rollouts[0].holder_name, 0) > 0
