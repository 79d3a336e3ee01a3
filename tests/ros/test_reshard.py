"""Reading a model-parallel version in another layout: TP-2 trainer ranks publish blocks of
column-split (dim 0) and row-split (dim 1) weights and a replicated norm; readers in TP-4,
TP-1 (the whole model) and TP-2 get exactly the global tensors' blocks they ask for."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import ros

OUT, IN = 64, 48  # a column-parallel weight [OUT, IN] split on dim 0; row-parallel on dim 1


def global_model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "qkv.weight": torch.randn(OUT, IN, generator=g),
        "o.weight": torch.randn(IN, OUT, generator=g).to(torch.bfloat16),
        "norm.weight": torch.randn(IN, generator=g),
        "step": torch.tensor(3, dtype=torch.int64),
    }


def block(name: str, rank: int, ranks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, shape) of rank's block of tensor `name` in a TP-`ranks` layout."""
    full = global_model()[name]
    if name == "qkv.weight":
        n = OUT // ranks
        return (rank * n, 0), (n, IN)
    if name == "o.weight":
        n = OUT // ranks
        return (0, rank * n), (IN, n)
    return (0,) * full.dim(), tuple(full.shape)  # replicated


def publish_tp(connect: Callable[..., ros.Hub], ranks: int) -> list[ros.Hub]:
    full = global_model()
    trainers = [connect() for _ in range(ranks)]
    for rank, trainer in enumerate(trainers):
        tensors, placements = {}, {}
        for name, tensor in full.items():
            offsets, shape = block(name, rank, ranks)
            index = tuple(slice(o, o + s) for o, s in zip(offsets, shape, strict=True))
            tensors[name] = tensor[index].contiguous()
            if name in ("qkv.weight", "o.weight"):
                placements[name] = (tuple(tensor.shape), offsets)
        trainer.publish(
            "policy", 1, tensors, shard=(rank, ranks), placements=placements, chunk_size=4096
        )
    return trainers


def read_tp(
    reader: ros.Hub, rank: int, ranks: int
) -> tuple[dict[str, torch.Tensor], ros.SliceFetch]:
    full = global_model()
    out, slices = {}, {}
    for name, tensor in full.items():
        offsets, shape = block(name, rank, ranks)
        out[name] = torch.empty(shape, dtype=tensor.dtype)
        slices[name] = ros.Slice(out[name], offsets, tuple(tensor.shape))
    got = reader.fetch_slices("policy", 1, slices=slices, timeout=30)
    assert got.version == 1
    return out, got


@pytest.mark.parametrize("reader_ranks", [4, 1, 2])
def test_readers_in_any_tensor_parallel_layout_get_exact_blocks(
    connect: Callable[..., ros.Hub], reader_ranks: int
) -> None:
    publish_tp(connect, 2)
    full = global_model()
    reader = connect()
    for rank in range(reader_ranks):
        got, _ = read_tp(reader, rank, reader_ranks)
        for name, tensor in full.items():
            offsets, shape = block(name, rank, reader_ranks)
            index = tuple(slice(o, o + s) for o, s in zip(offsets, shape, strict=True))
            assert torch.equal(got[name], tensor[index]), (name, rank)


def test_a_reader_fetches_only_the_chunks_of_its_block(connect: Callable[..., ros.Hub]) -> None:
    publish_tp(connect, 2)
    reader = connect()
    whole = sum(t.numel() * t.element_size() for t in global_model().values())
    quarter = read_tp(reader, 0, 4)[1].total_bytes
    everything = read_tp(reader, 0, 1)[1].total_bytes
    assert everything >= whole  # every byte of the model, from both shards
    assert quarter < everything * 0.75  # a TP-4 rank reads far less than the whole model


def test_bad_slices_are_refused_before_any_byte_moves(connect: Callable[..., ros.Hub]) -> None:
    publish_tp(connect, 2)
    reader = connect()
    qkv = torch.empty(16, IN)
    cases = {
        "unknown tensor": {"nope": ros.Slice(qkv, (0, 0), (OUT, IN))},
        "wrong global shape": {"qkv.weight": ros.Slice(qkv, (0, 0), (OUT + 1, IN))},
        "outside the tensor": {"qkv.weight": ros.Slice(qkv, (OUT - 8, 0), (OUT, IN))},
        "wrong dtype": {"qkv.weight": ros.Slice(qkv.double(), (0, 0), (OUT, IN))},
    }
    for what, slices in cases.items():
        try:
            reader.fetch_slices("policy", 1, slices=slices, timeout=10)
        except ros.InvalidArgument:
            continue
        pytest.fail(f"{what}: accepted")
    with pytest.raises(ros.InvalidArgument, match="pass shard"):
        reader.publish("other", 1, global_model(), placements={"qkv.weight": ((OUT, IN), (0, 0))})
    with pytest.raises(ros.InvalidArgument, match="does not fit"):
        reader.publish(
            "other", 1, {"w": torch.zeros(8, 8)}, shard=(0, 2), placements={"w": ((8, 8), (4, 0))}
        )


def test_blocks_that_do_not_cover_the_slice_are_refused(connect: Callable[..., ros.Hub]) -> None:
    trainer = connect()
    # two ranks whose blocks leave rows 24..32 of a 40-row tensor uncovered
    trainer.publish(
        "gappy", 1, {"w": torch.zeros(24, 4)}, shard=(0, 2), placements={"w": ((40, 4), (0, 0))}
    )
    other = connect()
    other.publish(
        "gappy", 1, {"w": torch.ones(8, 4)}, shard=(1, 2), placements={"w": ((40, 4), (32, 0))}
    )
    reader = connect()
    whole = {"w": ros.Slice(torch.empty(40, 4), (0, 0), (40, 4))}
    with pytest.raises(ros.InvalidArgument, match="cover 128 of the 160 elements"):
        reader.fetch_slices("gappy", 1, slices=whole, timeout=10)
    top = torch.empty(24, 4)
    reader.fetch_slices("gappy", 1, slices={"w": ros.Slice(top, (0, 0), (40, 4))}, timeout=10)
    assert torch.equal(top, torch.zeros(24, 4))


def test_a_whole_version_can_be_read_in_blocks_too(connect: Callable[..., ros.Hub]) -> None:
    connect().publish("whole", 1, global_model(), chunk_size=4096)
    full = global_model()
    reader = connect()
    for rank in range(4):
        got = {}
        slices = {}
        for name in ("qkv.weight", "o.weight"):
            offsets, shape = block(name, rank, 4)
            got[name] = torch.empty(shape, dtype=full[name].dtype)
            slices[name] = ros.Slice(got[name], offsets, tuple(full[name].shape))
        reader.fetch_slices("whole", 1, slices=slices, timeout=30)
        for name, tensor in got.items():
            offsets, shape = block(name, rank, 4)
            index = tuple(slice(o, o + s) for o, s in zip(offsets, shape, strict=True))
            assert torch.equal(tensor, full[name][index]), (name, rank)


def test_a_dead_holder_of_a_source_shard_is_replaced_by_another(
    connect: Callable[..., ros.Hub],
) -> None:
    trainers = publish_tp(connect, 2)
    standby = connect()
    standby.fetch("policy", 1, shard=0, timeout=30)  # a second holder of shard 0
    trainers[0]._serving.server.stop()  # shard 0's publisher stops serving; its record stays
    reader = connect()
    got, stats = read_tp(reader, 0, 1)  # the whole model: both shards
    for name, tensor in global_model().items():
        assert torch.equal(got[name], tensor), name
    assert trainers[0].holder_name in stats.failed_sources  # it was tried, and failed over
    assert trainers[0].holder_name not in stats.bytes_per_source
    assert stats.bytes_per_source.get(standby.holder_name, 0) > 0


def test_slices_are_filled_in_place_even_as_parameters_or_strided_views(
    connect: Callable[..., ros.Hub],
) -> None:
    """A rollout's slices are often a module's parameters (which require grad) or views of a
    larger fused buffer: both are written through, in place (before, a parameter failed with
    "a view of a leaf Variable that requires grad is being used in an in-place operation")."""
    publish_tp(connect, 2)
    full = global_model()
    qkv = torch.nn.Linear(IN, OUT, bias=False)  # the whole qkv.weight [OUT, IN], TP-1
    fused = torch.full((IN, 2 * OUT), 5.0, dtype=torch.bfloat16)
    o_block = fused[:, OUT:]  # o.weight [IN, OUT] as a strided view of a wider buffer
    assert not o_block.is_contiguous()
    pointers = (qkv.weight.data_ptr(), fused.data_ptr())
    slices = {
        "qkv.weight": ros.Slice(qkv.weight, (0, 0), (OUT, IN)),
        "o.weight": ros.Slice(o_block, (0, 0), (IN, OUT)),
    }
    connect().fetch_slices("policy", 1, slices=slices, timeout=30)
    assert torch.equal(qkv.weight.detach(), full["qkv.weight"])
    assert qkv.weight.requires_grad  # still the module's parameter
    assert torch.equal(o_block, full["o.weight"])
    assert torch.equal(fused[:, :OUT], torch.full((IN, OUT), 5.0, dtype=torch.bfloat16))
    assert (qkv.weight.data_ptr(), fused.data_ptr()) == pointers
