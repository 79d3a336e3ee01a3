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
checkpoint copy is kept and served to other rollouts until the next update.

Delta versions (`delta`, on by default): the host copy of the version last loaded is kept,
released (not served, unless `serve`), as the base of the next update, which is fetched
into that same memory; when the trainer published the version with `delta=True`, the SDK
then reads only its changes, checks each base chunk before applying and verifies after, and
reads whole whatever fails a check. **Memory: one host copy of the checkpoint per worker
between updates too** (with `serve` that copy is the one served: nothing more). A version
published as shards is read with `fetch_slices(delta=True)`: the SDK keeps its staging copy
of each source shard (in host memory) as the base, and the checkpoint tensors handed to the
model are new memory each update. **Memory then: one host copy of every source shard the
worker reads, between updates too** (the checkpoint's bytes, plus each replicated tensor once
more per extra shard), and none of the checkpoint. With `delta=False` and without `serve`,
nothing is kept between updates and every version is read whole; turning `delta` off, or
`close`, frees what was kept (the staging copies through `Hub.drop_bases`).

`update_vllm(llm, version)` is the trainer-side driver of one update, `declare_layout(llm,
hub)` declares its workers' blocks to the hub (publisher-checked reads from peers), and
`reload_weights` the thin path for set-ups without a weight-transfer engine (one process
only: tensors do not cross `collective_rpc` to worker processes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from ros.client.delta_stats import DeltaStats, summed
from ros.client.handles import Held
from ros.client.hub import Hub
from ros.client.manifest import layout_of, placement_of
from ros.client.slice import Slice
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import EngineNotReady, InvalidArgument, RetentionViolation
from transport.layout import torch_dtype
from transport.outcome import FetchStats

log = logging.getLogger(__name__)

DEFAULT_UPDATE_TIMEOUT = 120.0


class WeightSyncEngine(Protocol):
    """What `update_vllm` needs of a vLLM `LLM` (or anything with its weight-sync API)."""

    def start_weight_update(self) -> None: ...

    def update_weights(self, request: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    def collective_rpc(self, method: str) -> Any: ...


ABORT = "tensorhub_abort_update"
"""The worker-extension method (`ros.integrations.vllm_worker`) that ends a failed update's
session on the workers whose part of it succeeded."""

BLOCKS = "tensorhub_blocks"
"""The worker-extension method that answers a worker's model, layout and blocks as plain
data (`declare_layout`)."""


class VersionReceiver:
    """Fetches whole versions of `model` for one vLLM worker, in checkpoint layout.

    `receive(version)` returns the version and its `(name, tensor)` pairs once every byte is
    in; `loaded(version)` then releases the copy, or keeps it served until the next
    `receive` with `serve`. With `delta` (default) the released copy's memory is kept and the
    next version is fetched into it, so a version published as a delta moves only its
    changes (module docstring: one host copy of the checkpoint kept between updates; for a
    version published as shards, one host copy of every source shard, kept by the SDK).
    Not thread-safe: one worker drives it, one update at a time.
    """

    def __init__(
        self,
        hub: Hub,
        model: str,
        *,
        serve: bool = False,
        timeout: float = DEFAULT_UPDATE_TIMEOUT,
        delta: bool = True,
    ) -> None:
        self.hub = hub
        self.model = model
        self.serve = serve
        self.timeout = timeout
        self._delta = delta
        self.version = 0  # the version last loaded (0: none yet)
        self._held: Held | None = None  # the copy served (serve), or being loaded
        self._kept: list[Held] = []  # copies a release refused (past the spill budget)
        self._base: dict[str, torch.Tensor] | None = None  # released memory to fetch into
        self._base_version: int | None = None  # the version it holds (None: partly another)
        self._staged = False  # the hub may keep staging copies of shards for us (delta)
        self.last_stats: FetchStats | None = None  # what the last fetch read, from whom
        self.last_delta: DeltaStats | None = None  # what its delta did (None: read whole)

    @property
    def held_bytes(self) -> int:
        """Bytes of checkpoint copies this receiver holds and serves now."""
        return sum(_nbytes(h.tensors) for h in self._copies())

    @property
    def delta(self) -> bool:
        """Whether to keep the version loaded as the next update's base. Turning it off
        frees what is kept (the released copy, and the SDK's staging copies of shards)."""
        return self._delta

    @delta.setter
    def delta(self, on: bool) -> None:
        self._delta = on
        if not on:
            self._base, self._base_version = None, None
            self._drop_staged()

    @property
    def base_bytes(self) -> int:
        """Bytes kept as the next update's base (`delta`): the released copy of a whole
        version (0 with `serve`, whose served copy is the base), plus the staging copies of
        source shards the hub keeps for `fetch_slices(delta=True)` (`Hub.delta_memory`'s
        `staged`: of every model, if this receiver's hub is shared)."""
        kept = 0 if self._base is None else _nbytes(self._base)
        return kept + (self.hub.delta_memory()["staged"] if self._staged else 0)

    def receive(self, version: int | str = "latest") -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """`version` (default: the latest) and all its tensors, fetched in full before this
        returns. Raises the fetch's named error (`VersionUnavailable`, `DeadlineExceeded`,
        ...) with nothing changed but the previous copy released (its memory, the base of
        the next fetch, may hold part of this version then: the SDK checks every base chunk
        before applying a delta to it)."""
        number = 0 if version == "latest" else int(version)
        self._release_previous()
        # the manifest (cached: the fetch below does not ask for it again) says its shape
        resolved = self.hub.resolve(self.model, number, timeout=self.timeout)
        number = int(resolved.version)
        if resolved.shard_count or resolved.shards:
            # the bases of a sharded version are the SDK's staging copies of its shards
            self._base, self._base_version = None, None
            return number, self._receive_slices(number, list(resolved.shards))
        self._drop_staged()  # staging copies of shards: no base for a whole version
        into, self._base = self._base, None
        if into is not None and not _fits(into, resolved.manifest):
            log.info("%s@%d has another layout: fetching into new memory", self.model, number)
            into = None
        try:
            self._held = self.hub.fetch(
                self.model, number, into=into, timeout=self.timeout, delta=self.delta
            )
        except BaseException:
            # still this worker's memory, for the next update; what it holds is checked
            # chunk by chunk before a delta is applied to it
            self._base, self._base_version = into, None
            raise
        self.last_stats = self._held.stats
        self.last_delta = self._held.delta
        return number, list(self._held.tensors.items())

    def loaded(self, version: int) -> None:
        """The model now runs `version`: stop serving its copy, unless `serve`."""
        self.version = version
        if not self.serve:
            self._release_previous()

    def _receive_slices(
        self, version: int, parts: list[pb.Manifest]
    ) -> list[tuple[str, torch.Tensor]]:
        """A model-parallel version, each global tensor assembled from its shards (a
        reader of slices is no holder, so with `serve` nothing of it is served). With
        `delta`, the SDK applies each shard's delta to the staging copy of that shard it
        kept from the update before, and keeps the new one."""
        whole: dict[str, torch.Tensor] = {}
        slices: dict[str, Slice] = {}
        for part in parts:
            for entry in part.tensors:
                if entry.name in whole:
                    continue
                glob, _ = placement_of(entry)
                whole[entry.name] = torch.empty(glob, dtype=torch_dtype(entry.dtype))
                slices[entry.name] = Slice(whole[entry.name], (0,) * len(glob), glob)
        self._staged = self._staged or self.delta  # kept even if the fetch fails part-way
        got = self.hub.fetch_slices(
            self.model, version, slices=slices, timeout=self.timeout, delta=self.delta
        )
        self.last_stats = FetchStats(
            bytes_per_source=dict(got.bytes_per_source), chunks=got.chunks,
            failed_sources=dict(got.failed_sources), slow_sources=dict(got.slow_sources),
        )  # fmt: skip
        self.last_delta = summed(got.deltas)
        return list(whole.items())

    def _drop_staged(self) -> None:
        """Free the staging copies of shards the hub keeps for this model (with the
        publisher's base copies of it, should this hub publish the model too)."""
        if self._staged:
            self.hub.drop_bases(self.model)
            self._staged = False

    def _copies(self) -> list[Held]:
        return [*self._kept, *([self._held] if self._held is not None else [])]

    def _release_previous(self) -> None:
        """Stop serving the copies held; one a release refuses (the last complete holder of
        a retained version, past the client's spill budget) keeps serving, and is tried
        again at the next update. With `delta`, the memory of the copy just loaded, once
        released, is kept as the next fetch's base."""
        current = self._held
        previous = self._copies()
        self._held, self._kept = None, []
        for held in previous:
            try:
                held.release()
            except RetentionViolation as exc:
                log.warning("%s@%d still served: %s", self.model, held.version, exc)
                self._kept.append(held)
                continue
            if held is current and self.delta:
                self._base, self._base_version = held.tensors, held.version

    def loaded_copy(self) -> dict[str, torch.Tensor] | None:
        """The host copy (checkpoint layout) of the version the model runs: the one served
        (`serve`) or kept as the base (`delta`); None if neither is left. Read it, do not
        change it."""
        if self._held is not None and self._held.version == self.version:
            return dict(self._held.tensors)
        if self._base is not None and self._base_version == self.version:
            return self._base
        return None

    def close(self) -> None:
        """Stop serving (forced: the worker is going away), free the bases kept, and close
        the hub connection."""
        for held in self._copies():
            held.release(force=True)
        self._held, self._kept, self._base, self._base_version = None, [], None, None
        self._drop_staged()
        self.hub.close()


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _fits(tensors: dict[str, torch.Tensor], manifest: pb.Manifest) -> bool:
    """Whether `tensors` has the names, dtypes and shapes of `manifest`'s version."""
    try:
        layout_of(manifest).check_tensors(tensors)
    except InvalidArgument:
        return False
    return True


def update_vllm(
    llm: WeightSyncEngine, version: int, *, update_info: dict[str, Any] | None = None
) -> None:
    """Move `llm` (a vLLM `LLM` built with `weight_transfer_config={"backend": "tensorhub"}`
    and `init_weight_transfer_engine` done) to `version` of its model. Raises what the
    workers raised; a fetch that failed leaves every worker on its previous version.

    vLLM ends the update session only of the workers whose `update_weights` raised; the
    others' stays open, and every later `start_weight_update` would fail on them. So a
    failed update is ended on every worker (`ABORT`, which needs the `LLM` built with
    `worker_extension_cls=WORKER_EXTENSION`) without loading what they read, before its
    error is raised."""
    info = {"version": int(version), **(update_info or {})}
    llm.start_weight_update()
    try:
        llm.update_weights({"update_info": info})
    except Exception:
        _abort(llm)
        raise
    llm.finish_weight_update(weight_version=str(version))


def _abort(llm: WeightSyncEngine) -> None:
    """End a failed update's session on every worker (`ABORT`); where that fails (no
    worker extension, an engine that is gone), log it: the update's own error is raised."""
    try:
        llm.collective_rpc(ABORT)
    except Exception as exc:  # vLLM's errors: untyped here
        log.warning(
            "the failed update's sessions were not ended on the workers (%s): a worker whose "
            "part succeeded refuses the next update until its session ends", exc,
        )  # fmt: skip


def declare_layout(llm: WeightSyncEngine, hub: Hub, *, timeout: float | None = None) -> str:
    """Declare the layout of `llm`'s workers (each reading its blocks: `"slices"`, the
    default at tensor-parallel size > 1) to `hub`, so that every whole version the trainer
    publishes from then on carries its checksums of each worker's blocks, and the workers
    of every instance of this layout check each chunk they read from a peer against them
    (`Hub.declare_layout`; docs/sdk.md, "Declared layouts"). Call it after the first
    update, where the workers learn their blocks (`EngineNotReady` before; the `LLM` needs
    `worker_extension_cls=WORKER_EXTENSION`), and again if the checkpoint's tensors
    change. `hub` is any client of the tenant: it reads no weights. The layout's name."""
    answers = [dict(a) for a in llm.collective_rpc(BLOCKS)]
    if not answers or any(a["model"] is None for a in answers):
        raise EngineNotReady("init_weight_transfer_engine first: the workers have no model")
    models = {str(a["model"]) for a in answers}
    layouts = {a["layout"] for a in answers}
    if len(models) != 1 or None in layouts or len(layouts) != 1:
        raise InvalidArgument(
            f"declare_layout: the workers read {sorted(models)} in layouts "
            f"{sorted(map(str, layouts))}: one model, each worker reading its blocks in one "
            'layout ("slices") is what a layout declares'
        )
    if any(not a["blocks"] for a in answers):
        raise EngineNotReady(
            "declare_layout before the first update: the workers learn their blocks there"
        )
    [model], [layout] = models, layouts
    workers = [_declared_slices(a["blocks"]) for a in answers]
    hub.declare_layout(model, str(layout), workers, timeout=timeout)
    return str(layout)


def _declared_slices(blocks: dict[str, list[Any]]) -> dict[str, Slice]:
    """One worker's blocks (`BLOCKS`' rows: dtype, global shape, offsets, shape) as the
    slices `Hub.declare_layout` takes; their tensors have no memory (only their dtypes and
    shapes are read)."""
    return {
        name: Slice(
            torch.empty(tuple(shape), dtype=torch_dtype(dtype), device="meta"),
            tuple(int(o) for o in offsets),
            tuple(int(d) for d in glob),
        )
        for name, (dtype, glob, offsets, shape) in blocks.items()
    }


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
