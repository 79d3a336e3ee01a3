"""Delta versions on a real hub (docs/sdk.md, "Delta versions"): a publisher with
`delta=True` publishes each next version also as encoded changes against the one before,
and a reader whose memory holds that one reads only the changes, verified chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import ros
from tensorhub.delta_rules import companion_of

CHUNK = 64 << 10  # small chunks: many of them in a small model


def model(seed: int, n: int = 6) -> dict[str, torch.Tensor]:
    """bf16 weights, 6 x 256 KiB."""
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(128 * 1024, generator=g).to(torch.bfloat16) for i in range(n)}


def step(weights: dict[str, torch.Tensor], seed: int, share: float = 0.01) -> dict[str, torch.Tensor]:
    """The next version: `share` of the elements nudged (as an RL step changes ~1 %)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        mask = torch.rand(t.shape, generator=g) < share
        out[name] = torch.where(mask, (t.float() * 1.01).to(torch.bfloat16), t)
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def test_a_reader_applies_each_next_version_from_its_delta(connect: Callable[..., ros.Hub]) -> None:
    trainer, reader = connect(), connect()
    w = model(1)
    trainer.publish("policy", 1, w, chunk_size=CHUNK, delta=True)
    held = reader.fetch("policy", 1)
    assert held.delta is None
    for v in range(2, 5):
        w = step(w, v)
        pub = trainer.publish("policy", v, w, chunk_size=CHUNK, delta=True)
        assert pub.companion is not None
        tensors = held.tensors
        held.release()
        held = reader.fetch("policy", v, into=tensors)
        assert same(held.tensors, w)
        assert held.delta is not None and held.delta.base == v - 1, held.delta
        assert held.delta.chunks > 0 and held.delta.base_mismatch == 0, held.delta
        full = sum(t.numel() * 2 for t in w.values())
        assert held.delta.encoded_bytes < 0.2 * full, held.delta
        assert held.stats.total_bytes < full, held.stats
    holders = trainer.holders(companion_of("policy"), 4)
    assert reader.holder_name in {h.holder for h in holders}
