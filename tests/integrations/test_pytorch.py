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
