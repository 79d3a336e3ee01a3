"""Plain PyTorch: publish and fetch `state_dict`s and `nn.Module`s through the SDK.

Tied tensors (two names over the same memory, e.g. a tied embedding and LM head) are sent
once, under the first name in `state_dict` order. Fetching into a module or a state dict
that is tied the same way fills that memory once, so the names come back **tied** (the
same storage, not just equal). A plain `hub.fetch` without a target gets the first name only.

Non-contiguous tensors: the SDK publishes a contiguous copy (a snapshot, logged), and a
non-contiguous fetch target is filled through a contiguous staging tensor that the returned
`Held` serves, then copied into place.

Delta versions, on by default here (in the bare SDK they are opt-in): the publish helpers
pass `delta=True`, so the client keeps a copy of what it published (`base_copy`: "host"
memory by default, or "device", the tensors' own), **one more copy of the model**, and
publishes each next version of the same model also as its changes against that copy; the
fetch helpers fill the same module or state dict each time, so a reader whose memory holds
the version before reads only those changes (`Held.delta` says what moved), each chunk
checked against the base before it is applied and verified after. `delta=False` on either
side turns it off: no copy kept, every chunk read whole (docs/sdk.md, "Delta versions").
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
    delta: bool = True,
    base_copy: str = "host",
) -> Publication:
    """Publish `state` as `model@version`, tied tensors once; served from `state`'s memory
    (release the publication before changing it). A model-parallel rank passes
    `shard=(rank, ranks)` with its own part of the state.

    `delta` (default True): also publish it as its changes against this client's previous
    `delta=True` publish of the model (and shard), and keep a copy of it for the next one:
    one more copy of the model, in `base_copy` memory ("host" or "device"). False: no copy
    kept, no delta published (`Hub.publish`)."""
    unique, _ = dedupe_tied(state)
    return hub.publish(
        model, version, unique, chunk_size=chunk_size, timeout=timeout, shard=shard,
        delta=delta, base_copy=base_copy,
    )  # fmt: skip


def publish_module(
    hub: Hub,
    model: str,
    version: int,
    module: nn.Module,
    *,
    chunk_size: int | None = None,
    timeout: float | None = None,
    shard: tuple[int, int] | None = None,
    delta: bool = True,
    base_copy: str = "host",
) -> Publication:
    """Publish a module's `state_dict()` (parameters and persistent buffers); `delta` and
    `base_copy` as `publish_state_dict`'s (on by default: one more copy of the model)."""
    return publish_state_dict(
        hub, model, version, module.state_dict(), chunk_size=chunk_size, timeout=timeout,
        shard=shard, delta=delta, base_copy=base_copy,
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
    delta: bool = True,
) -> Held:
    """Fetch `model@version` in place into `into` (tied like the publisher's state).

    Names, dtypes and shapes must match, or `InvalidArgument` is raised before any byte is
    written. The version is served to others until the returned `Held` is released; release
    it before the next fetch into the same memory. Of a model-parallel version, rank
    `shard`'s part (in the publisher's layout; see `Hub.fetch_slices` for another one).

    Fetching into the same memory as this client's previous fetch of the model reads only
    the changes when the version was published with a delta (`delta`, default True; no
    memory of its own: the destination is the base). `Held.delta` says what it did;
    `delta=False` reads every chunk whole. An `into` with a non-contiguous tensor is filled
    through new staging memory each time, so it is always read whole.
    """
    unique, _ = dedupe_tied(into)
    staged = {name: t for name, t in unique.items() if not t.is_contiguous()}
    target = {
        name: torch.empty_like(t, memory_format=torch.contiguous_format) if name in staged else t
        for name, t in unique.items()
    }
    held = hub.fetch(
        model, version, into=target, timeout=timeout, shard=shard, progress=progress, delta=delta
    )
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
    delta: bool = True,
) -> Held:
    """Fetch `model@version` in place into `module`'s own parameters and buffers
    (`progress`: `Hub.fetch`'s; `delta`: `fetch_state_dict`'s, the changes only when the
    module holds the version before)."""
    return fetch_state_dict(
        hub, model, version, into=module.state_dict(), timeout=timeout, shard=shard,
        progress=progress, delta=delta,
    )  # fmt: skip
