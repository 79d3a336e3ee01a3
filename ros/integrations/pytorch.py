"""Plain PyTorch: publish and fetch `state_dict`s and `nn.Module`s through the SDK.

Tied tensors (two names over the same memory, e.g. a tied embedding and LM head) are sent
once, under the first name in `state_dict` order. Fetching into a module or a state dict
that is tied the same way fills that memory once, so the names come back **tied** (the
same storage, not just equal). A plain `hub.fetch` without a target gets the first name only.

Non-contiguous tensors: the SDK publishes a contiguous copy (a snapshot, logged), and a
non-contiguous fetch target is filled through a contiguous staging tensor that the returned
`Held` serves, then copied into place.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ros.client.handles import Held, Publication
from ros.client.hub import DEFAULT_FETCH_TIMEOUT, Hub
from ros.client.orchestrator import ProgressCallback
from tensorhub.errors import InvalidArgument


def dedupe_tied(
    state: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Split `state` into the tensors to transfer (one per distinct view of memory) and the
    aliases left out, as `{alias: name it is tied to}`."""
    first: dict[tuple[object, ...], str] = {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgument(f"{name!r} is not a tensor")
        view = tensor.detach()
        if view.numel() == 0:
            unique[name] = view
            continue
        key = (str(view.device), view.data_ptr(), view.dtype, tuple(view.shape), view.stride())
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
            unique[name] = view
    return unique, aliases


def publish_state_dict(
    hub: Hub,
    model: str,
    version: int,
    state: Mapping[str, torch.Tensor],
    *,
    chunk_size: int | None = None,
    timeout: float | None = None,
    shard: tuple[int, int] | None = None,
) -> Publication:
    """Publish `state` as `model@version`, tied tensors once; served from `state`'s memory
    (release the publication before changing it). A model-parallel rank passes
    `shard=(rank, ranks)` with its own part of the state."""
    unique, _ = dedupe_tied(state)
    return hub.publish(model, version, unique, chunk_size=chunk_size, timeout=timeout, shard=shard)


def publish_module(
    hub: Hub,
    model: str,
    version: int,
    module: nn.Module,
    *,
    chunk_size: int | None = None,
    timeout: float | None = None,
    shard: tuple[int, int] | None = None,
) -> Publication:
    """Publish a module's `state_dict()` (parameters and persistent buffers)."""
    return publish_state_dict(
        hub, model, version, module.state_dict(), chunk_size=chunk_size, timeout=timeout,
        shard=shard,
    )  # fmt: skip


def fetch_state_dict(
    hub: Hub,
    model: str,
    version: int | str = "latest",
    *,
    into: Mapping[str, torch.Tensor],
    timeout: float = DEFAULT_FETCH_TIMEOUT,
    shard: int | None = None,
    progress: ProgressCallback | None = None,
) -> Held:
    """Fetch `model@version` in place into `into` (tied like the publisher's state).

    Names, dtypes and shapes must match, or `InvalidArgument` is raised before any byte is
    written. The version is served to others until the returned `Held` is released; release
    it before the next fetch into the same memory. Of a model-parallel version, rank
    `shard`'s part (in the publisher's layout; see `Hub.fetch_slices` for another one).
    """
    unique, _ = dedupe_tied(into)
    staged = {name: t for name, t in unique.items() if not t.is_contiguous()}
    target = {
        name: torch.empty_like(t, memory_format=torch.contiguous_format) if name in staged else t
        for name, t in unique.items()
    }
    held = hub.fetch(model, version, into=target, timeout=timeout, shard=shard, progress=progress)
    with torch.no_grad():
        for name, tensor in staged.items():
            tensor.copy_(held.tensors[name])
    return held


def fetch_module(
    hub: Hub,
    model: str,
    module: nn.Module,
    version: int | str = "latest",
    *,
    timeout: float = DEFAULT_FETCH_TIMEOUT,
    shard: int | None = None,
    progress: ProgressCallback | None = None,
) -> Held:
    """Fetch `model@version` in place into `module`'s own parameters and buffers
    (`progress`: `Hub.fetch`'s)."""
    return fetch_state_dict(
        hub, model, version, into=module.state_dict(), timeout=timeout, shard=shard,
        progress=progress,
    )  # fmt: skip
