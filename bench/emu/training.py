"""The model `bench delta` and `bench crossdc` train between versions: a real transformer.

A Llama (transformers' `LlamaForCausalLM` built from a `LlamaConfig`: no download) with
tied input and output embeddings, trained with AdamW (weight decay 0.01) on fp32 master
weights; each version published is the bf16 copy of every parameter. At the default size
(`DEFAULT`: vocab 8192, hidden 512, intermediate 1408, 10 layers) that is 36,317,696
parameters, 69.3 MiB in bf16.

Every parameter is trainable and every one gets a gradient at every step: the embedding is
tied to the output projection, whose softmax reaches every vocabulary row whatever the
tokens, so every embedding row is touched by every batch (a batch holding all 8192 token
ids as input would cost about 20 s a step on one core here; a tied embedding costs
nothing more). The input tokens are consecutive slices of a seeded permutation of all
token ids (each id is an input once every `vocab / (batch x seq)` steps). The data is
random tokens: nothing is tuned to make versions alike, and Adam's first steps move every
weight by about the learning rate whatever the gradient's size.

Deterministic on the CPU for a seed (one thread): `bench crossdc` trains the same versions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

WEIGHT_DECAY = 0.01


@dataclass(frozen=True)
class Spec:
    """The model's shape, the batch, and the seed of the weights and the data."""

    vocab: int = 8192
    hidden: int = 512
    intermediate: int = 1408
    layers: int = 10
    heads: int = 8
    batch: int = 4
    seq: int = 128
    seed: int = 7

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def params(self) -> int:
        """Parameters (tied embedding counted once; Llama has no biases)."""
        h, i = self.hidden, self.intermediate
        layer = 4 * h * h + 3 * h * i + 2 * h
        return self.vocab * h + self.layers * layer + h

    @property
    def nbytes(self) -> int:
        """Bytes of a bf16 version."""
        return 2 * self.params


DEFAULT = Spec()
TINY = Spec(vocab=1024, hidden=128, intermediate=256, layers=2, heads=4, batch=2, seq=32)
"""About 1.1 MiB in bf16: for tests of the harness, not for figures."""


def missing() -> str:
    """Why the model cannot be built here ('' if it can): transformers is a dev extra."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed (pip install -e '.[dev]')"
    return ""


class Training:
    """The model, its optimizer and its data; `step()` trains one batch, `weights()` is the
    bf16 copy to publish."""

    def __init__(self, spec: Spec, lr: float) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        self.spec = spec
        torch.manual_seed(spec.seed)
        config = LlamaConfig(
            vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
            num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
            num_key_value_heads=spec.heads, max_position_embeddings=spec.seq,
            tie_word_embeddings=True,
        )  # fmt: skip
        self.model = LlamaForCausalLM(config).train()  # fp32: the master weights
        for p in self.model.parameters():
            p.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY
        )
        gen = torch.Generator().manual_seed(spec.seed + 1)
        self.tokens = torch.randperm(spec.vocab, generator=gen)
        self.steps = 0

    def step(self) -> float:
        """One optimizer step on the next batch; its loss."""
        n = self.spec.batch * self.spec.seq
        at = (self.steps * n) % self.spec.vocab
        order = self.tokens.roll(-at).repeat(-(-n // self.spec.vocab))
        ids = order[:n].reshape(self.spec.batch, self.spec.seq)
        out = self.model(input_ids=ids, labels=ids)
        out.loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return float(out.loss.item())

    def weights(self) -> dict[str, torch.Tensor]:
        """A new bf16 copy of every parameter (the tied embedding once)."""
        with torch.no_grad():
            return {
                name: p.detach().to(torch.bfloat16).contiguous()
                for name, p in self.model.named_parameters()
            }
