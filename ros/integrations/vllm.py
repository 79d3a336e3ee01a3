"""vLLM: what its `tensorhub` weight-transfer engine does inside each worker, without vLLM.

vLLM updates weights through its weight-transfer API: the trainer side calls
`llm.start_weight_update()`, `llm.update_weights(...)`, `llm.finish_weight_update()`, and
the engine registered under the backend name (`ros.integrations.vllm_engine`, loaded into
every worker process by the `vllm.general_plugins` entry point) receives the weights there.
The parameters of a vLLM CPU model are repacked for its kernels, so nothing may be written
into them directly; the weights go in, in checkpoint naming, through the model's layerwise
reload (`load_weights` between `initialize_layerwise_reload` and `finalize_layerwise_reload`).

`VersionReceiver` is the TensorHub half of that: it fetches a whole version into host
tensors it owns, in checkpoint layout, **before** anything touches the model, so a fetch
that fails (no holder left, the deadline) raises its named error with the model still on the
previous version, never half-updated. A model-parallel version (trainer ranks publishing
shards with placements) is read whole with `fetch_slices`: vLLM's loaders take full
checkpoint tensors and cut each worker's tensor-parallel part themselves. With `serve`, the
checkpoint copy is kept and served to other rollouts until the next update (it costs one
copy of the checkpoint in host memory, between updates too); without, it is released once
loaded, and it costs that copy only during an update.

`update_vllm(llm, version)` is the trainer-side driver of one update, and `reload_weights`
the thin path for set-ups without a weight-transfer engine (one process only: tensors do not
cross `collective_rpc` to worker processes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from ros.client.handles import Held
from ros.client.hub import Hub
from ros.client.manifest import placement_of
from ros.client.slices import Slice
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument, RetentionViolation
from transport.layout import torch_dtype
from transport.outcome import FetchStats

log = logging.getLogger(__name__)

DEFAULT_UPDATE_TIMEOUT = 120.0


class WeightSyncEngine(Protocol):
    """What `update_vllm` needs of a vLLM `LLM` (or anything with its weight-sync API)."""

    def start_weight_update(self) -> None: ...

    def update_weights(self, request: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class VersionReceiver:
    """Fetches whole versions of `model` for one vLLM worker, in checkpoint layout.

    `receive(version)` returns the version and its `(name, tensor)` pairs once every byte is
    in; `loaded(version)` then releases the copy, or keeps it served until the next
    `receive` with `serve`. Not thread-safe: one worker drives it, one update at a time.
    """

    def __init__(
        self, hub: Hub, model: str, *, serve: bool = False, timeout: float = DEFAULT_UPDATE_TIMEOUT
    ) -> None:
        self.hub = hub
        self.model = model
        self.serve = serve
        self.timeout = timeout
        self.version = 0  # the version last loaded (0: none yet)
        self._held: Held | None = None  # the copy served (serve), or being loaded
        self._kept: list[Held] = []  # copies a release refused (past the spill budget)
        self.last_stats: FetchStats | None = None  # what the last fetch read, from whom

    @property
    def held_bytes(self) -> int:
        """Bytes of checkpoint copies this receiver holds now (its memory cost)."""
        return sum(t.numel() * t.element_size() for h in self._copies() for t in h.tensors.values())

    def receive(self, version: int | str = "latest") -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """`version` (default: the latest) and all its tensors, fetched in full before this
        returns. Raises the fetch's named error (`VersionUnavailable`, `DeadlineExceeded`,
        ...) with nothing changed but the previous copy released."""
        number = 0 if version == "latest" else int(version)
        self._release_previous()
        # the manifest (cached: the fetch below does not ask for it again) says its shape
        resolved = self.hub.resolve(self.model, number, timeout=self.timeout)
        number = int(resolved.version)
        if resolved.shard_count or resolved.shards:
            return number, self._receive_slices(number, list(resolved.shards))
        self._held = self.hub.fetch(self.model, number, timeout=self.timeout)
        self.last_stats = self._held.stats
        return number, list(self._held.tensors.items())

    def loaded(self, version: int) -> None:
        """The model now runs `version`: stop serving its copy, unless `serve`."""
        self.version = version
        if not self.serve:
            self._release_previous()

    def _receive_slices(
        self, version: int, parts: list[pb.Manifest]
    ) -> list[tuple[str, torch.Tensor]]:
        """A model-parallel version, read whole: each global tensor from its shards (a
        reader of slices is no holder, so with `serve` nothing of it is served)."""
        whole: dict[str, torch.Tensor] = {}
        slices: dict[str, Slice] = {}
        for part in parts:
            for entry in part.tensors:
                if entry.name in whole:
                    continue
                glob, _ = placement_of(entry)
                whole[entry.name] = torch.empty(glob, dtype=torch_dtype(entry.dtype))
                slices[entry.name] = Slice(whole[entry.name], (0,) * len(glob), glob)
        self.hub.fetch_slices(self.model, version, slices=slices, timeout=self.timeout)
        return list(whole.items())

    def _copies(self) -> list[Held]:
        return [*self._kept, *([self._held] if self._held is not None else [])]

    def _release_previous(self) -> None:
        """Stop serving the copies held; one a release refuses (the last complete holder of
        a retained version, past the client's spill budget) keeps serving, and is tried
        again at the next update."""
        previous = self._copies()
        self._held, self._kept = None, []
        for held in previous:
            try:
                held.release()
            except RetentionViolation as exc:
                log.warning("%s@%d still served: %s", self.model, held.version, exc)
                self._kept.append(held)

    def close(self) -> None:
        """Stop serving (forced: the worker is going away) and close the hub connection."""
        for held in self._copies():
            held.release(force=True)
        self._held, self._kept = None, []
        self.hub.close()


def update_vllm(
    llm: WeightSyncEngine, version: int, *, update_info: dict[str, Any] | None = None
) -> None:
    """Move `llm` (a vLLM `LLM` built with `weight_transfer_config={"backend": "tensorhub"}`
    and `init_weight_transfer_engine` done) to `version` of its model. Raises what the
    workers raised; a fetch that failed leaves every worker on its previous version."""
    info = {"version": int(version), **(update_info or {})}
    llm.start_weight_update()
    llm.update_weights({"update_info": info})
    llm.finish_weight_update(weight_version=str(version))


def reload_weights(llm: Any, receiver: VersionReceiver, version: int | str = "latest") -> int:
    """The path without a weight-transfer engine: fetch `version` here, then hand the
    tensors to vLLM's own `reload_weights` over `collective_rpc`. Only for an `LLM` whose
    worker runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the `uni` executor):
    tensors do not pickle to worker processes. Returns the version loaded."""
    number, weights = receiver.receive(version)
    if not weights:
        raise InvalidArgument(f"{receiver.model}@{number} has no tensors")
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
    receiver.loaded(number)
    return number


def weights_iterator(held: Held) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` of every tensor of a fetched version, in manifest order."""
    yield from held.tensors.items()
