"""The SDK end to end in one process: publish, latest, fetch (new and in place), release."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ros


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(256, 64, generator=g),
        "layer.0.bias": torch.randn(64, generator=g),
        "head.weight": torch.randn(10, 64, generator=g).to(torch.bfloat16),
        "step": torch.tensor(seed, dtype=torch.int64),
    }


def test_publish_fetch_release(connect: Callable[..., ros.Hub]) -> None:
    trainer, reader = connect(), connect()
    weights = model(1)
    pub = trainer.publish("policy", 1, weights)
    assert pub.version == 1
    assert reader.latest("policy") == 1
    held = reader.fetch("policy", "latest", timeout=30)
    assert held.version == 1
    for name, tensor in weights.items():
        assert torch.equal(held.tensors[name], tensor), name
    assert pub.wait_replicated(1, timeout=10) >= 1
    pub.release()
    held.release(force=True)


def test_fetch_into_validates_before_writing(connect: Callable[..., ros.Hub]) -> None:
    trainer, reader = connect(), connect()
    trainer.publish("policy", 1, model(1))
    target = model(2)
    target["embed.weight"] = torch.zeros(255, 64)
    before = {k: v.clone() for k, v in target.items()}
    with pytest.raises(ros.InvalidArgument, match="shape"):
        reader.fetch("policy", 1, into=target)
    for name, tensor in before.items():
        assert torch.equal(tensor, target[name])
    good = model(3)
    held = reader.fetch("policy", 1, into=good)
    assert held.tensors["embed.weight"].data_ptr() == good["embed.weight"].data_ptr()
    assert torch.equal(good["layer.0.bias"], model(1)["layer.0.bias"])


def test_last_holder_spills_to_safetensors_and_keeps_serving(
    connect: Callable[..., ros.Hub], tmp_path: Path
) -> None:
    trainer, reader = connect(spill_budget=0), connect()  # no host spill: the file it is
    weights = model(5)
    expected = {k: v.clone() for k, v in weights.items()}
    pub = trainer.publish("policy", 1, weights)
    with pytest.raises(ros.SpillBudgetExceeded, match="last complete holder"):
        pub.release()
    target = tmp_path / "policy-1.safetensors"
    pub.release(spill=target)
    for tensor in weights.values():  # the trainer's memory is free again: overwrite it
        tensor.zero_()
    held = reader.fetch("policy", 1, timeout=30)
    for name, tensor in expected.items():
        assert torch.equal(held.tensors[name], tensor), name
    assert trainer.holder_name in [h.holder for h in reader.holders("policy", 1)]
    loaded = load_file(str(target))  # a standard safetensors file
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_model_parallel_publish_becomes_visible_with_the_last_rank(
    connect: Callable[..., ros.Hub],
) -> None:
    ranks = [connect() for _ in range(3)]
    watcher = connect()
    parts = [{f"layer.{r}.weight": torch.full((64,), float(r))} for r in range(3)]
    first = ranks[2].publish("policy", 1, parts[2], shard=(2, 3))
    second = ranks[0].publish("policy", 1, parts[0], shard=(0, 3))
    assert not first.visible
    assert not second.visible
    assert watcher.latest("policy") == 0  # not before every shard is there
    last = ranks[1].publish("policy", 1, parts[1], shard=(1, 3))
    assert last.visible
    assert watcher.latest("policy") == 1
    with pytest.raises(ros.InvalidArgument, match="model-parallel"):
        watcher.fetch("policy", 1, timeout=5)  # one shard at a time: test_sharded_fetch.py
