"""The vLLM adapter against a stand-in with vLLM's `load_weights` contract (vLLM is not
installed here): checkpoint names in, the model maps them (q/k/v fused into qkv_proj)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar

import pytest
import torch
from torch import nn

import ros
from ros.integrations.vllm import VLLMWeightUpdater, weights_iterator


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.q_proj.weight": torch.randn(8, 8, generator=g),
        "layers.0.k_proj.weight": torch.randn(8, 8, generator=g),
        "layers.0.v_proj.weight": torch.randn(8, 8, generator=g),
        "layers.0.o_proj.weight": torch.randn(8, 8, generator=g),
    }


class StandInVLLMModel(nn.Module):
    """Like a vLLM model: fused qkv, and `load_weights` that maps checkpoint names."""

    STACKED: ClassVar[dict[str, int]] = {"q_proj": 0, "k_proj": 1, "v_proj": 2}

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.qkv_proj = nn.Parameter(torch.zeros(24, 8), requires_grad=False)
        self.o_proj = nn.Parameter(torch.zeros(8, 8), requires_grad=False)
        self.events = events

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self.events.append("load")
        loaded = set()
        for name, tensor in weights:
            part = name.split(".")[-2]
            if part in self.STACKED:
                shard = self.STACKED[part]
                self.qkv_proj.data[shard * 8 : (shard + 1) * 8].copy_(tensor)
                loaded.add("qkv_proj")
            else:
                self.o_proj.data.copy_(tensor)
                loaded.add("o_proj")
        return loaded


def test_updater_pauses_only_around_load_weights(connect: Callable[..., ros.Hub]) -> None:
    trainer, rollout = connect(), connect()
    events: list[str] = []
    engine = StandInVLLMModel(events)
    updater = VLLMWeightUpdater(
        rollout, "policy", engine.load_weights,
        pause=lambda: events.append("pause"), resume=lambda: events.append("resume"),
        timeout=30,
    )  # fmt: skip
    for version in (1, 2):
        weights = checkpoint(version)
        pub = trainer.publish("policy", version, weights)
        assert updater.update() == version
        assert pub.wait_replicated(1, timeout=10) == 1  # the staging copy is served
        pub.release()
        expected_qkv = torch.cat([weights[f"layers.0.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(engine.qkv_proj, expected_qkv)
        assert torch.equal(engine.o_proj, weights["layers.0.o_proj.weight"])
    assert events == ["pause", "load", "resume"] * 2
    assert updater.update() == 2  # nothing newer: a no-op, no pause
    assert events == ["pause", "load", "resume"] * 2
    updater.close()


def test_resume_runs_even_when_loading_fails(connect: Callable[..., ros.Hub]) -> None:
    trainer, rollout = connect(), connect()
    events: list[str] = []

    def broken(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise KeyError("unexpected weight name")

    updater = VLLMWeightUpdater(
        rollout, "policy", broken, pause=lambda: events.append("pause"),
        resume=lambda: events.append("resume"), timeout=30,
    )  # fmt: skip
    pub = trainer.publish("policy", 1, checkpoint(1))
    with pytest.raises(KeyError):
        updater.update()
    assert events == ["pause", "resume"]
    assert updater.version == 0
    pub.release(force=True)
    updater.close()


def test_weights_iterator_yields_manifest_order(connect: Callable[..., ros.Hub]) -> None:
    trainer, rollout = connect(), connect()
    weights = checkpoint(5)
    pub = trainer.publish("policy", 1, weights)
    held = rollout.fetch("policy", 1, timeout=30)
    pairs = list(weights_iterator(held))
    assert [n for n, _ in pairs] == list(weights)
    assert all(torch.equal(t, weights[n]) for n, t in pairs)
    pub.release(force=True)
    held.release(force=True)
