"""Hugging Face `transformers`: fetch into a tiny model built from a config (no download);
greedy generation must match the trainer's copy token for token."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import ros
from ros.integrations.hf import fetch_pretrained, publish_pretrained

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (it is in the dev extras)"
)


def tiny(kind: str, seed: int) -> Any:
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=2
        )
    else:
        config = transformers.LlamaConfig(
            vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def greedy(model: Any) -> torch.Tensor:
    prompt = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        out: torch.Tensor = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
    return out


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_greedy_generation_matches_the_trainer(connect: Callable[..., ros.Hub], kind: str) -> None:
    trainer, rollout = connect(), connect()
    policy, replica = tiny(kind, 1), tiny(kind, 2)
    assert not torch.equal(greedy(policy), greedy(replica))  # different weights differ
    pub = publish_pretrained(trainer, kind, 1, policy)
    held = fetch_pretrained(rollout, kind, replica, timeout=30)
    assert torch.equal(greedy(replica), greedy(policy))
    if kind == "gpt2":  # tied embeddings stay tied on the reader
        assert replica.lm_head.weight.data_ptr() == replica.transformer.wte.weight.data_ptr()
    pub.release(force=True)
    held.release(force=True)


def test_second_step_reads_only_the_changes(connect: Callable[..., ros.Hub]) -> None:
    """Deltas are on by default: step 2, fetched into the model holding step 1, reads the
    encoded changes only, and generates as the trainer's copy does."""
    trainer, rollout = connect(), connect()
    policy, replica = tiny("llama", 1), tiny("llama", 2)
    full = sum(t.numel() * t.element_size() for t in policy.state_dict().values())
    pub = publish_pretrained(trainer, "hf-delta", 1, policy)
    held = fetch_pretrained(rollout, "hf-delta", replica, timeout=30)
    pub.release()
    held.release()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in policy.parameters():  # an RL-sized step: 1 % of the elements change
            p.copy_(torch.where(torch.rand(p.shape, generator=g) < 0.01, p * 1.01, p))
    pub = publish_pretrained(trainer, "hf-delta", 2, policy)
    held = fetch_pretrained(rollout, "hf-delta", replica, timeout=30)
    assert held.delta is not None
    assert held.delta.chunks > 0, held.delta
    assert held.delta.encoded_bytes + held.stats.total_bytes < full, (held.delta, held.stats)
    for name, tensor in policy.state_dict().items():
        assert torch.equal(replica.state_dict()[name], tensor), name
    assert torch.equal(greedy(replica), greedy(policy))
    pub.release(force=True)
    held.release(force=True)
