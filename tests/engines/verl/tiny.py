"""Tiny Hugging Face Llama models for the verl backend's tests: built from a config (no
download), made to change deterministically between versions, and compared by digest."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SMALL = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128}
"""About 0.4 MB: one chunk, for the version-by-version tests."""

LARGE = {"vocab_size": 8192, "hidden_size": 256, "intermediate_size": 512}
"""About 20 MB: five or six 4 MiB chunks, so that a slowed holder can die mid-fetch."""


def build(size: Mapping[str, int], seed: int = 0) -> LlamaForCausalLM:
    """A two-layer Llama with `size`'s dimensions, its weights drawn from `seed`."""
    config = LlamaConfig(
        **size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def step(model: torch.nn.Module, seed: int) -> None:
    """One deterministic "optimizer step": every parameter moves by noise drawn from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.01)


def nudge(model: torch.nn.Module, seed: int, share: float = 0.01) -> None:
    """An RL-sized step: `share` of each parameter's elements change a little, the rest keep
    their bytes (what a delta version is made for; `step` changes every element)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            mask = torch.rand(param.shape, generator=generator) < share
            param.copy_(torch.where(mask, param * 1.01, param))


def per_tensor(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What verl's engines hand `send_weights`: a generator of (name, full tensor)."""
    for name, tensor in model.state_dict().items():
        yield name, tensor.detach()


def digest(tensor: torch.Tensor) -> str:
    """The bytes of `tensor` (dtype and shape included), as a hex digest."""
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    meta = f"{tensor.dtype}{tuple(tensor.shape)}".encode()
    return hashlib.sha256(meta + data).hexdigest()


def digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    return {name: digest(tensor) for name, tensor in tensors.items()}
