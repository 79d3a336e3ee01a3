"""Helpers shared by the SDK tests: deterministic models and digests, a raw read."""

from __future__ import annotations

import time

import torch
import xxhash

import ros
from transport.layout import Layout
from transport.planner import Source
from transport.reader import fetch
from transport.store import HeldVersion
from transport.topology import Topology


def make_model(seed: int, *, big: int = 256 * 64, small: int = 20) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {"embed.weight": torch.randn(big, generator=g).reshape(-1, 64)}
    for i in range(small):
        tensors[f"layers.{i}.norm"] = torch.randn(64, generator=g)
    tensors["head.weight"] = torch.randn(10, 64, generator=g).to(torch.bfloat16)
    return tensors


def digest(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        name: xxhash.xxh3_64_hexdigest(
            t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        )
        for name, t in sorted(tensors.items())
    }


def read_policy_1(holder: ros.Hub, token: bytes) -> None:
    """A raw data-plane read of `policy`@1 (`make_model(1)`) from `holder`'s own port with
    the given read token: what a holder accepts, bypassing the SDK's token handling."""
    layout = Layout.from_tensors(make_model(1))
    dest = HeldVersion.reader(holder.tenant, "policy", 1, layout, layout.allocate())
    host, port = holder._serving.server.address
    fetch(
        holder.tenant, "policy", 1, layout, dest,
        [Source(holder.holder_name, host, port, Topology())],
        token=token, deadline=time.monotonic() + 5, me=Topology(),
    )  # fmt: skip
