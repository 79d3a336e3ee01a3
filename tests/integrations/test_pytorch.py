"""Plain PyTorch through a real hub: state dicts, modules, tied and non-contiguous tensors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import ros
from ros.integrations.pytorch import (
    dedupe_tied,
    fetch_module,
    fetch_state_dict,
    publish_module,
    publish_state_dict,
)


class TiedLM(nn.Module):
    """A toy LM whose output head shares the embedding's weight (like GPT-2)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(50, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.tensor(seed))


def test_module_roundtrip_in_place_keeps_tied_weights_tied(
    connect: Callable[..., ros.Hub],
) -> None:
    trainer, reader = connect(), connect()
    source, target = TiedLM(1), TiedLM(2)
    pub = publish_module(trainer, "lm", 1, source)
    embed_ptr = target.embed.weight.data_ptr()
    held = fetch_module(reader, "lm", target, timeout=30)
    assert "head.weight" not in held.tensors  # tied: sent once, under the first name
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name
    assert target.head.weight.data_ptr() == target.embed.weight.data_ptr() == embed_ptr
    pub.release()
    held.release(force=True)


def test_update_cycle_release_then_fetch_in_place(connect: Callable[..., ros.Hub]) -> None:
    trainer, reader = connect(), connect()
    source, target = TiedLM(1), TiedLM(2)
    first = publish_module(trainer, "lm", 1, source)
    held = fetch_module(reader, "lm", target, timeout=30)
    first.release()
    with torch.no_grad():
        source.norm.weight.add_(1.0)
    second = publish_module(trainer, "lm", 2, source)
    with pytest.raises(ros.InvalidArgument, match="release it"):
        fetch_module(reader, "lm", target, timeout=30)  # still serving v1 from that memory
    held.release(force=True)
    held = fetch_module(reader, "lm", target, timeout=30)
    assert held.version == 2
    assert torch.equal(target.norm.weight, source.norm.weight)
    second.release(force=True)
    held.release(force=True)


def test_non_contiguous_tensors_both_sides(connect: Callable[..., ros.Hub]) -> None:
    trainer, reader = connect(), connect()
    base = torch.arange(64.0).reshape(8, 8)
    state = {"t": base.t(), "rows": base[::2], "plain": torch.ones(3)}
    pub = publish_state_dict(trainer, "nc", 1, state)
    base.zero_()  # the SDK published contiguous copies: a snapshot, unaffected
    target_base = torch.full((8, 8), -1.0)
    target = {"t": target_base.t(), "rows": torch.zeros(4, 8), "plain": torch.zeros(3)}
    held = fetch_state_dict(reader, "nc", into=target, timeout=30)
    expected = torch.arange(64.0).reshape(8, 8)
    assert torch.equal(target["t"], expected.t())  # filled through a staging copy
    assert torch.equal(target_base, expected)
    assert torch.equal(target["rows"], expected[::2])
    assert held.tensors["t"].is_contiguous()
    pub.release(force=True)
    held.release(force=True)


def test_plain_fetch_of_a_tied_module_has_the_first_name_only(
    connect: Callable[..., ros.Hub],
) -> None:
    trainer, reader = connect(), connect()
    source = TiedLM(3)
    unique, aliases = dedupe_tied(source.state_dict())
    assert aliases == {"head.weight": "embed.weight"}
    pub = publish_module(trainer, "lm", 1, source)
    held = reader.fetch("lm", 1, timeout=30)
    assert set(held.tensors) == set(unique)
    assert torch.equal(held.tensors["embed.weight"], source.head.weight)
    pub.release(force=True)
    held.release(force=True)


def test_model_parallel_ranks_publish_and_fetch_their_own_modules(
    connect: Callable[..., ros.Hub],
) -> None:
    """Two pipeline stages (different modules) publish as shards; each reader stage fetches
    its own stage's module in place."""
    stages = [nn.Linear(8, 16), nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 4))]
    trainers = [connect() for _ in stages]
    for rank, (trainer, stage) in enumerate(zip(trainers, stages, strict=True)):
        publish_module(trainer, "pp", 1, stage, shard=(rank, len(stages)))
    readers = [nn.Linear(8, 16), nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 4))]
    client = connect()
    for rank, stage in enumerate(readers):
        with torch.no_grad():
            for p in stage.parameters():
                p.zero_()
        fetch_module(connect(), "pp", stage, 1, timeout=30, shard=rank)  # one client a rank
        for name, tensor in stages[rank].state_dict().items():
            assert torch.equal(stage.state_dict()[name], tensor), (rank, name)
    with pytest.raises(ros.InvalidArgument, match="model-parallel"):
        fetch_module(client, "pp", nn.Linear(8, 16), 1, timeout=10)  # which stage? say so
    fetch_module(client, "pp", nn.Linear(8, 16), 1, timeout=30, shard=0)
    with pytest.raises(ros.AlreadyExists, match="one client each"):
        fetch_module(client, "pp", readers[1], 1, timeout=10, shard=1)


# -- delta versions, on by default in the helpers -------------------------------------------


class Bf16Policy(nn.Module):
    """bf16 weights (what a trainer publishes from fp32 masters), 16 chunks of 64 KiB."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Linear(512, 1024).to(torch.bfloat16)


def nudge(module: nn.Module, seed: int, share: float = 0.01) -> None:
    """An RL-sized step: `share` of the elements change, a little."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            mask = torch.rand(p.shape, generator=g) < share
            p.copy_(torch.where(mask, (p.float() * 1.01).to(p.dtype), p))


def equal_bytes(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[k].view(torch.int16), sb[k].view(torch.int16)) for k in sa
    )


DELTA_CHUNK = 64 << 10


def test_helpers_publish_and_fetch_deltas_by_default(connect: Callable[..., ros.Hub]) -> None:
    """Two steps: the second fetch into the same module reads the encoded changes only, and
    the module ends with the trainer's exact bytes."""
    trainer, reader = connect(), connect()
    source, target = Bf16Policy(1), Bf16Policy(2)
    full = sum(t.numel() * t.element_size() for t in source.state_dict().values())
    first = publish_module(trainer, "d", 1, source, chunk_size=DELTA_CHUNK)
    held = fetch_module(reader, "d", target, 1, timeout=30)
    assert held.delta is None  # no base yet: read whole
    assert held.stats.total_bytes == full
    first.release()
    held.release()
    nudge(source, seed=2)
    second = publish_module(trainer, "d", 2, source, chunk_size=DELTA_CHUNK)
    assert second.companion is not None  # published as a delta against v1 too
    held = fetch_module(reader, "d", target, 2, timeout=30)
    assert equal_bytes(target, source)
    assert held.delta is not None
    assert held.delta.base == 1, held.delta
    assert held.delta.chunks > 0, held.delta
    assert held.delta.base_mismatch == 0, held.delta
    moved = held.delta.encoded_bytes + held.stats.total_bytes
    assert moved < full / 4, (held.delta, held.stats)
    second.release(force=True)
    held.release(force=True)


@pytest.mark.parametrize("side", ["publisher", "reader"])
def test_delta_false_reads_whole(connect: Callable[..., ros.Hub], side: str) -> None:
    """The switch, on either side: the publisher keeps no copy and publishes no delta, or
    the reader ignores the delta; either way the second step is read whole."""
    trainer, reader = connect(), connect()
    source, target = Bf16Policy(1), Bf16Policy(2)
    full = sum(t.numel() * t.element_size() for t in source.state_dict().values())
    publish_on = side != "publisher"
    read_on = side != "reader"
    first = publish_module(trainer, "d", 1, source, chunk_size=DELTA_CHUNK, delta=publish_on)
    held = fetch_module(reader, "d", target, 1, timeout=30, delta=read_on)
    first.release()
    held.release()
    nudge(source, seed=2)
    second = publish_module(trainer, "d", 2, source, chunk_size=DELTA_CHUNK, delta=publish_on)
    assert (second.companion is not None) == publish_on
    held = fetch_module(reader, "d", target, 2, timeout=30, delta=read_on)
    assert equal_bytes(target, source)
    assert held.delta is None, held.delta
    assert held.stats.total_bytes == full
    second.release(force=True)
    held.release(force=True)
