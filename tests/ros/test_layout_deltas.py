"""Deltas for layout holders (docs/design-notes.md, "Deltas for layout holders";
`fetch_slices(layout=..., delta=True)`): a reader in a layout that holds version 1's blocks
reads only the changes of version 2 that fall inside them, from the companion's holders,
against a real hub and etcd; every reader ends on the publisher's bytes, through the
fallback when its base was changed or a companion holder serves corrupt bytes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import ros
from tests.ros.layout_model import CHUNK, block, global_model

MODEL = "policy"


def step(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The next version: 1 % of the floating-point elements nudged, as an RL step."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        if not t.is_floating_point():
            out[name] = t.clone()
            continue
        mask = torch.rand(t.shape, generator=g) < 0.01
        out[name] = torch.where(mask, (t.float() * 1.01).to(t.dtype), t)
    return out


def blocks_of(weights: dict[str, torch.Tensor], rank: int, ranks: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in weights.items():
        offsets, shape = block(name, rank, ranks)
        index = tuple(slice(o, o + s) for o, s in zip(offsets, shape, strict=True))
        out[name] = tensor[index].contiguous()
    return out


def slices_for(rank: int, ranks: int) -> tuple[dict[str, torch.Tensor], dict[str, ros.Slice]]:
    out, slices = {}, {}
    for name, tensor in global_model().items():
        offsets, shape = block(name, rank, ranks)
        out[name] = torch.zeros(shape, dtype=tensor.dtype)
        slices[name] = ros.Slice(out[name], offsets, tuple(tensor.shape))
    return out, slices


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(
        torch.equal(got[n].reshape(-1).view(torch.uint8), want[n].reshape(-1).view(torch.uint8))
        for n in want
    )


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def publish_shards(trainers: list[ros.Hub], version: int, weights: dict[str, torch.Tensor]) -> None:
    """TP-2 trainer ranks publish their shards of `weights`, with deltas."""
    for rank, trainer in enumerate(trainers):
        tensors, placements = {}, {}
        for name, tensor in weights.items():
            offsets, _ = block(name, rank, len(trainers))
            tensors[name] = blocks_of(weights, rank, len(trainers))[name]
            if name.endswith(("qkv.weight", "o.weight")):
                placements[name] = (tuple(tensor.shape), offsets)
        trainer.publish(
            MODEL, version, tensors, shard=(rank, len(trainers)), placements=placements,
            chunk_size=CHUNK, delta=True,
        )  # fmt: skip


@pytest.mark.parametrize(("rank", "ranks"), [(0, 2), (0, 1)])
def test_a_layout_reader_applies_the_deltas_inside_its_blocks(
    connect: Callable[..., ros.Hub], rank: int, ranks: int
) -> None:
    """A TP-2 worker (the trainer's own split) and a TP-1 one (every block across both
    source shards) at version 1 read version 2's changes only, end on its exact bytes, and
    serve them: a second reader of the same blocks reads every byte from the first."""
    trainers = [connect(), connect()]
    reader, second = connect(), connect()
    w1 = global_model()
    publish_shards(trainers, 1, w1)
    layout = f"tp{ranks}"
    out, slices = slices_for(rank, ranks)
    whole = reader.fetch_slices(MODEL, 1, slices=slices, layout=layout, delta=True, timeout=30)
    assert same(out, blocks_of(w1, rank, ranks))
    assert whole.served
    assert not whole.deltas
    assert reader.release_blocks(MODEL, 1)
    w2 = step(w1, 2)
    publish_shards(trainers, 2, w2)
    got = reader.fetch_slices(MODEL, 2, slices=slices, layout=layout, delta=True, timeout=30)
    assert same(out, blocks_of(w2, rank, ranks))
    assert got.served
    assert set(got.deltas) == ({0} if ranks == 2 else {0, 1})  # replicated tensors: shard 0
    assert sum(s.chunks for s in got.deltas.values()) > 0
    assert all(s.base_mismatch == 0 and s.links == 1 for s in got.deltas.values())
    moved = got.total_bytes
    print(f"\nlayout {layout}: blocks {nbytes(out)} B; whole step moved {whole.total_bytes} B, "
          f"delta step {moved} B (encoded {sum(s.encoded_bytes for s in got.deltas.values())} "
          f"B, blocks read whole {sorted(got.from_trainer)})")  # fmt: skip
    assert whole.total_bytes >= nbytes(out)
    assert moved < nbytes(out) / 4
    # the next reader of the same blocks reads version 2's from the one that applied it
    out2, slices2 = slices_for(rank, ranks)
    again = second.fetch_slices(MODEL, 2, slices=slices2, layout=layout, timeout=30)
    assert same(out2, blocks_of(w2, rank, ranks))
    assert again.bytes_per_source == {reader.holder_name: nbytes(out2)}


def test_a_base_changed_between_fetches_is_read_whole_and_counted(
    connect: Callable[..., ros.Hub],
) -> None:
    """Memory changed after the blocks were released is not version 1: the chunks it
    touches fail the base check, are counted, and are read whole; the others apply."""
    trainers = [connect(), connect()]
    reader = connect()
    w1 = global_model()
    publish_shards(trainers, 1, w1)
    out, slices = slices_for(0, 2)
    reader.fetch_slices(MODEL, 1, slices=slices, layout="tp2", delta=True, timeout=30)
    reader.release_blocks(MODEL, 1)
    out["l1.qkv.weight"][3, 7] += 1.0  # the caller's memory, changed behind the base
    w2 = step(w1, 3)
    publish_shards(trainers, 2, w2)
    got = reader.fetch_slices(MODEL, 2, slices=slices, layout="tp2", delta=True, timeout=30)
    assert same(out, blocks_of(w2, 0, 2))
    assert got.deltas[0].base_mismatch == 1
    assert got.deltas[0].chunks > 0
    assert got.total_bytes > got.deltas[0].encoded_bytes  # the changed chunk, read whole
    assert got.served


def test_a_companion_served_corrupt_is_rejected_and_the_blocks_read_whole(
    connect: Callable[..., ros.Hub],
) -> None:
    """The companion's only holder serves bytes other than the publisher's: its chunks fail
    the companion manifest's checksums, the delta is given up, and the blocks are read
    whole from the trainer: exact."""
    trainer, middle, reader = connect(), connect(), connect()
    w1 = global_model()
    trainer.publish(MODEL, 1, w1, chunk_size=CHUNK, delta=True)
    base = middle.fetch(MODEL, 1)
    base.release()
    out, slices = slices_for(1, 2)
    reader.fetch_slices(MODEL, 1, slices=slices, layout="tp2", delta=True, timeout=30)
    reader.release_blocks(MODEL, 1)
    w2 = step(w1, 4)
    pub = trainer.publish(MODEL, 2, w2, chunk_size=CHUNK, delta=True)
    bad = middle.fetch(MODEL, 2, into=base.tensors)
    assert bad.companion is not None
    assert pub.companion is not None
    pub.companion.release(force=True)  # the corrupt holder is the companion's only one now
    for blob in bad.companion.tensors.values():
        blob.view(-1)[:: CHUNK // 2] ^= 0x5A  # its memory changed behind its back
    got = reader.fetch_slices(MODEL, 2, slices=slices, layout="tp2", delta=True, timeout=30)
    assert same(out, blocks_of(w2, 1, 2))
    assert got.deltas[None].chunks == 0
    assert "could not be read" in got.deltas[None].fallback, got.deltas[None]
    assert "failed its checksum" in got.deltas[None].fallback  # the companion manifest's
    assert got.served


def test_blocks_two_versions_behind_are_read_whole(connect: Callable[..., ros.Hub]) -> None:
    """Version 3's delta is against 2, and the blocks hold 1: no chain is followed, the
    blocks are read whole, and the stats say why."""
    trainers = [connect(), connect()]
    reader = connect()
    w1 = global_model()
    publish_shards(trainers, 1, w1)
    out, slices = slices_for(0, 2)
    reader.fetch_slices(MODEL, 1, slices=slices, layout="tp2", delta=True, timeout=30)
    reader.release_blocks(MODEL, 1)
    w3 = step(step(w1, 5), 6)
    publish_shards(trainers, 2, step(w1, 5))
    publish_shards(trainers, 3, w3)
    got = reader.fetch_slices(MODEL, 3, slices=slices, layout="tp2", delta=True, timeout=30)
    assert same(out, blocks_of(w3, 0, 2))
    assert got.deltas[0].chunks == 0
    assert "against 2" in got.deltas[0].fallback, got.deltas[0]
    assert got.total_bytes >= nbytes(out)


def test_a_delta_that_changes_most_words_is_not_read(connect: Callable[..., ros.Hub]) -> None:
    """A step that nudges every element (its delta in the dense form, chunks encoded up to
    0.8 of their size) would read more encoded bytes than half the blocks they make: the
    blocks are read whole, the fallback says why, and no companion byte is read."""
    trainers = [connect(), connect()]
    reader = connect()
    w1 = global_model()
    publish_shards(trainers, 1, w1)
    out, slices = slices_for(0, 2)
    reader.fetch_slices(MODEL, 1, slices=slices, layout="tp2", delta=True, timeout=30)
    assert reader.release_blocks(MODEL, 1)
    w2 = {n: (t + 1e-3).to(t.dtype) if t.is_floating_point() else t for n, t in w1.items()}
    publish_shards(trainers, 2, w2)
    got = reader.fetch_slices(MODEL, 2, slices=slices, layout="tp2", delta=True, timeout=30)
    assert same(out, blocks_of(w2, 0, 2))
    assert got.deltas, "the delta's stats say why it was not used"
    for stats in got.deltas.values():
        assert stats.chunks == 0
        assert stats.encoded_bytes == 0
        assert "of the blocks they make" in stats.fallback, stats.fallback
    assert got.total_bytes >= nbytes(out)
