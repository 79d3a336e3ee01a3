"""The demo's policy and task: a contextual bandit that REINFORCE learns in a few steps.

The context is a vector of `FEATURES` normal features; the right action is the index of the
largest of the first `ACTIONS` features, reward 1 if picked, else 0. A random policy scores
1/ACTIONS. The policy is a small MLP plus a bank of extra weights that brings it to the size
the user asked for, so the weight transfer is as heavy as a real model's while training stays
cheap. The bank is trained too: each piece's per-action means are added to the logits, so
every one of its weights gets a gradient and Adam moves it by about `BANK_LEARNING_RATE` per
step, which changes about 1.4 % of the bf16 words a trainer publishes, as an RL step on a
real model does (its means start near 0 and move by at most that rate per step: the bandit
is learnt by the MLP alone). The trainer keeps float32 masters and publishes bf16 copies;
rollouts run the bf16 policy. Everything is seeded: the same flags give the same reward curve.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import xxhash
from torch import nn

FEATURES = 16
ACTIONS = 8
HIDDEN = 32
LEARNING_RATE = 0.1
BANK_LEARNING_RATE = 1e-5  # the bank's step: an RL-sized one (LEARNING_RATE is the MLP's)
MASTER = torch.float32  # the trainer's weights
PUBLISHED = torch.bfloat16  # what it publishes and the rollouts run
PAD_PIECE_BYTES = 64 << 20  # the bank comes in tensors of at most this size (published)
MIN_CHUNK, MAX_CHUNK = 64 << 10, 4 << 20


class Policy(nn.Module):
    """An MLP over the context, plus a bank of `bank_elements` weights in `dtype`."""

    def __init__(self, bank_elements: int = 0, dtype: torch.dtype = MASTER) -> None:
        super().__init__()
        self.dtype = dtype
        self.body = nn.Sequential(
            nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, ACTIONS)
        ).to(dtype)
        pieces = []
        left = max(bank_elements, 0)
        per_piece = PAD_PIECE_BYTES // PUBLISHED.itemsize
        while left > 0:
            n = min(left, per_piece)
            pieces.append(nn.Parameter(torch.zeros(n, dtype=dtype)))
            left -= n
        self.padding = nn.ParameterList(pieces)

    def forward(self, contexts: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.body(contexts.to(self.dtype))
        for piece in self.padding:
            usable = piece.numel() - piece.numel() % ACTIONS
            if usable:
                logits = logits + piece[:usable].view(ACTIONS, -1).mean(dim=1)
        return logits

    def bank(self) -> list[nn.Parameter]:
        return list(self.padding)


def build_policy(
    model_mb: float, seed: int, *, initialise: bool, dtype: torch.dtype = MASTER
) -> Policy:
    """The policy of a `model_mb` MB model (counted in `PUBLISHED`, what moves), in `dtype`.
    The trainer initialises it from `seed` (the bank uniform in [-1, 1], so that byte checks
    mean something) in float32; rollouts build it in bf16 from zeros and get everything from
    the hub."""
    body_elements = sum(p.numel() for p in Policy(0).parameters())
    torch.manual_seed(seed)
    bank = (int(model_mb * (1 << 20)) // PUBLISHED.itemsize) - body_elements
    policy = Policy(bank, dtype)
    if initialise:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for piece in policy.padding:
                piece.uniform_(-1.0, 1.0, generator=g)
    else:
        with torch.no_grad():
            for p in policy.parameters():
                p.zero_()
    return policy


def optimizer_for(policy: Policy) -> torch.optim.Optimizer:
    """Adam: the MLP at `LEARNING_RATE`, the bank at `BANK_LEARNING_RATE` (with an epsilon
    below its gradients, which shrink with the size of a piece, so that its step is about
    that rate whatever the model's size). One tensor at a time (`foreach=False`): Adam's
    temporaries are then the size of a piece, not of the model."""
    groups: list[dict[str, Any]] = [
        {"params": list(policy.body.parameters())},
        {"params": policy.bank(), "lr": BANK_LEARNING_RATE, "eps": 1e-20},
    ]
    return torch.optim.Adam(groups, lr=LEARNING_RATE, foreach=False)


def published_copy(policy: Policy) -> dict[str, torch.Tensor]:
    """New `PUBLISHED` tensors for the trainer's state, named as a rollout's state dict."""
    return {n: torch.empty_like(t, dtype=PUBLISHED) for n, t in policy.state_dict().items()}


def refresh(published: Mapping[str, torch.Tensor], policy: Policy) -> None:
    """Round the masters into the published copy, in place (its memory stays the same)."""
    with torch.no_grad():
        for name, master in policy.state_dict().items():
            published[name].copy_(master)


def contexts(seed: int, batch: int) -> torch.Tensor:
    """The contexts of one rollout batch; the trainer rebuilds them from the same seed."""
    return torch.randn(batch, FEATURES, generator=torch.Generator().manual_seed(seed))


def rewards(ctx: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """1.0 where the action is the largest of the first ACTIONS features, else 0.0."""
    return (actions == ctx[:, :ACTIONS].argmax(dim=1)).float()


def sample(policy: Policy, ctx: torch.Tensor, seed: int) -> torch.Tensor:
    """Actions drawn from the policy (what a rollout generates)."""
    with torch.no_grad():
        probs = torch.softmax(policy(ctx).float(), dim=-1)
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
