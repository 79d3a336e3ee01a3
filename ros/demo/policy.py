"""The demo's policy and task: a contextual bandit that REINFORCE learns in a few steps.

The context is a vector of `FEATURES` normal features; the right action is the index of the
largest of the first `ACTIONS` features, reward 1 if picked, else 0. A random policy scores
1/ACTIONS. The policy is a small MLP, padded with frozen parameters to reach the size the
user asked for, so the weight transfer is as heavy as a real model's while training stays
cheap. Everything is seeded: the same flags give the same reward curve.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import xxhash
from torch import nn

FEATURES = 16
ACTIONS = 8
HIDDEN = 32
LEARNING_RATE = 0.1
PAD_PIECE_BYTES = 64 << 20  # frozen padding comes in tensors of at most this size
MIN_CHUNK, MAX_CHUNK = 64 << 10, 4 << 20


class Policy(nn.Module):
    """An MLP over the context, plus `pad_bytes` of frozen float32 parameters."""

    def __init__(self, pad_bytes: int = 0) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, ACTIONS)
        )
        pieces = []
        left = max(pad_bytes, 0) // 4
        while left > 0:
            n = min(left, PAD_PIECE_BYTES // 4)
            pieces.append(nn.Parameter(torch.zeros(n), requires_grad=False))
            left -= n
        self.padding = nn.ParameterList(pieces)

    def forward(self, contexts: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.body(contexts)
        return logits


def build_policy(model_mb: float, seed: int, *, initialise: bool) -> Policy:
    """The policy of a `model_mb` MB model. The trainer initialises it from `seed` (random
    padding too, so that byte checks mean something); rollouts start from zeros and get
    everything from the hub."""
    body_bytes = sum(p.numel() * 4 for p in Policy(0).parameters())
    torch.manual_seed(seed)
    policy = Policy(int(model_mb * (1 << 20)) - body_bytes)
    if initialise:
        g = torch.Generator().manual_seed(seed + 1)
        for piece in policy.padding:
            piece.data.uniform_(-1.0, 1.0, generator=g)
    else:
        with torch.no_grad():
            for p in policy.parameters():
                p.zero_()
    return policy


def contexts(seed: int, batch: int) -> torch.Tensor:
    """The contexts of one rollout batch; the trainer rebuilds them from the same seed."""
    return torch.randn(batch, FEATURES, generator=torch.Generator().manual_seed(seed))


def rewards(ctx: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """1.0 where the action is the largest of the first ACTIONS features, else 0.0."""
    return (actions == ctx[:, :ACTIONS].argmax(dim=1)).float()


def sample(policy: Policy, ctx: torch.Tensor, seed: int) -> torch.Tensor:
    """Actions drawn from the policy (what a rollout generates)."""
    with torch.no_grad():
        probs = torch.softmax(policy(ctx), dim=-1)
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(probs, 1, generator=g).squeeze(1)


def reinforce_loss(
    policy: Policy, ctx: torch.Tensor, actions: torch.Tensor, r: torch.Tensor
) -> torch.Tensor:
    """REINFORCE with the batch-mean reward as baseline."""
    logp = torch.log_softmax(policy(ctx), dim=-1).gather(1, actions[:, None]).squeeze(1)
    return -((r - r.mean()) * logp).mean()


def digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """xxh3-64 over every tensor's bytes in order: what "identical bytes" is checked with."""
    h = xxhash.xxh3_64()
    for name, tensor in tensors.items():
        h.update(name.encode())
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def chunk_size_for(total_bytes: int) -> int:
    """About 64 chunks per version (between 64 KiB and 4 MiB), so that several rollouts can
    pipeline a version from each other even when the model is small."""
    size = max(MIN_CHUNK, min(MAX_CHUNK, total_bytes // 64))
    return size - size % 64
