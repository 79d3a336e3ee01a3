"""verl: a checkpoint-engine backend, `tensorhub`, on verl's `CheckpointEngineRegistry`.

verl (0.9.x) syncs weights from the trainer (the actor worker group) to the rollout replicas
through a checkpoint engine. Per update, its `CheckpointEngineManager` calls on every worker
`prepare()`, then the class's `build_topology(actor_world_size, rollout_world_size, metadata)`
(metadata: what `prepare` returned, actor ranks first), then `init_process_group(**kwargs)`
with each worker's share of the topology, then `await send_weights(generator)` on every actor
rank and `receive_weights()` (what the rollout's server adapter iterates) on every rollout
worker, all at once, and `finalize()` last.

This backend replaces the broadcast group with the hub:

- `prepare()` on actor rank 0 (the one created with `is_master=True`) picks this update's
  version, `latest() + 1`, so versions stay monotonic across restarts of a run on one tenant;
  `build_topology` hands that version to every worker, so each rollout fetches exactly the
  version this update publishes (never the previous one, if it looked before the publish).
- `send_weights` on rank 0 copies the `(name, tensor)` stream into contiguous host tensors it
  owns (the stream's tensors are transient: FSDP gathers each one and frees it), and publishes
  them as one version; the other actor ranks only walk the stream (producing it is collective
  over the actor group). Memory: one host copy of the full model on rank 0, reused from one
  version to the next once the previous publication is released.
- `receive_weights` waits for the version (a `versions_only` watch, deadline-bound), releases
  the previous version it held, fetches the new one into that same memory and only then yields
  `(name, tensor)` pairs: a fetch that fails yields nothing, so the engine never loads a mix
  of two versions. What it fetched stays served to the other rollouts until the next update.
- Every wait has a deadline (`timeout`), and every failure is a named `tensorhub` error.
- Delta versions (`delta`, on by default): rank 0 publishes with `delta=True`, keeping a copy
  of what it published (`base_copy`: "host" memory by default) so that each next version is
  also published as its changes, and each rollout fetches into the memory of the version it
  held, so it reads only those changes (checked against the base chunk by chunk, verified
  after, whole where a check fails). **Memory: one more host copy of the full model on actor
  rank 0** (beside its staging copy), plus the encoded changes while they are served; the
  rollouts need none (their own copy is the base). `delta=False` keeps no copy and reads
  every version whole.

In verl's config (engine kwargs reach the constructor; the module is imported on every worker
before the backend is built):

    actor_rollout_ref.rollout.checkpoint_engine.backend=tensorhub
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=ros.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.tensorhub.hub=10.0.0.1:7600
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.tensorhub.model=policy

`hub`, `tenant` and `token` default to `TENSORHUB_HUB`, `TENSORHUB_TENANT` and
`TENSORHUB_TOKEN` in the workers' environment (keep the token out of the config).
This module imports verl (and Ray): only import it where verl is installed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry

import ros
from consistency.events import EventKind
from ros.client.handles import Held, Publication
from ros.client.hub import Hub
from tensorhub.errors import (
    DeadlineExceeded,
    InvalidArgument,
    RetentionViolation,
)

log = logging.getLogger(__name__)

BACKEND = "tensorhub"
"""The name this backend is registered under (`checkpoint_engine.backend`)."""

DEFAULT_TIMEOUT = 300.0
"""Seconds one `send_weights` or `receive_weights` may take, waits and transfer included."""

ACTOR, ROLLOUT = "actor", "rollout"

Weights = Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]]


async def _items(weights: Weights) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """Both kinds of stream verl hands over: a plain generator (`get_per_tensor_param`) or an
    async one (another engine's `receive_weights`), walked on the caller's thread."""
    if isinstance(weights, AsyncIterable):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


def _env(value: str | None, name: str, what: str) -> str:
    found = value or os.environ.get(name)
    if not found:
        raise InvalidArgument(f"tensorhub checkpoint engine: no {what}: pass it or set {name}")
    return found


@CheckpointEngineRegistry.register(BACKEND)
class TensorHubCheckpointEngine(CheckpointEngine):  # type: ignore[misc]  # verl is untyped (Any)
    """verl checkpoint engine that moves each weight update through TensorHub.

    Built by verl with `bucket_size` (unused: the hub chunks versions itself) and, on actor
    workers, `is_master` (True on actor rank 0, the one publisher); every other argument comes
    from `checkpoint_engine.engine_kwargs.tensorhub` (`delta=False` turns delta versions off:
    no base copy on rank 0, whole fetches). One hub client per engine (per worker
    process), opened on first use and kept across updates so that what it holds stays served;
    `client`, when given (code that builds the engine itself, tests), is used instead and left
    open by `close()`.
    """

    wire_format = "named_tensors"

    def __init__(
        self,
        bucket_size: int = 0,
        is_master: bool = False,
        *,
        hub: str | Sequence[str] | None = None,
        tenant: str | None = None,
        token: str | None = None,
        model: str = "policy",
        timeout: float = DEFAULT_TIMEOUT,
        topology: Mapping[str, str] | None = None,
        listen: str = "127.0.0.1:0",
        advertise: str | None = None,
        session_ttl: int = 10,
        spill_budget: int | None = None,
        delta: bool = True,
        base_copy: str = "host",
        client: Hub | None = None,
    ) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.model = model
        self.timeout = float(timeout)
        self.delta = bool(delta)  # publish (rank 0) and apply (rollouts) delta versions
        self.base_copy = base_copy  # where rank 0 keeps its copy for the next delta
        self._owned = client is None  # a client passed in is its owner's to close
        self._hub: Hub | None = client
        if client is None:
            self._endpoints: list[str] = (
                _env(hub, "TENSORHUB_HUB", "hub address").split(",")
                if hub is None or isinstance(hub, str)
                else list(hub)
            )
            self._tenant = _env(tenant, "TENSORHUB_TENANT", "tenant")
            self._token = _env(token, "TENSORHUB_TOKEN", "token")
        self._options: dict[str, Any] = {
            "topology": dict(topology) if topology else None,
            "listen": listen,
            "advertise": advertise,
            "session_ttl": session_ttl,
            "spill_budget": spill_budget,
        }
        self._lock = threading.Lock()
        # this update (from build_topology): the role and rank in it, and its version
        self.role: str | None = None
        self.rank: int | None = None
        self.version: int | None = None
        # what this engine serves: the last publication or fetch, and those kept serving
        # because releasing them would have dropped a retained version (retried each update)
        self.publication: Publication | None = None
        self.held: Held | None = None
        self._kept: list[Publication | Held] = []
        self.last_version = 0

    # -- the client ---------------------------------------------------------------------

    @property
    def hub(self) -> Hub:
        """This worker's hub client, connected on first use."""
        with self._lock:
            if self._hub is None:
                self._hub = ros.connect(
                    self._endpoints, tenant=self._tenant, token=self._token, **self._options
                )
            return self._hub

    # -- the manager's protocol ---------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """Per update, before the topology: actor rank 0 picks the version it will publish
        (`latest() + 1`: monotonic, and a run restarted on the same tenant goes on from
        there); every worker reports whether it is that rank."""
        metadata: dict[str, Any] = {"is_master": self.is_master}
        if self.is_master:
            metadata["version"] = self.hub.latest(self.model, timeout=self.timeout) + 1
        return metadata

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Give every worker its role, rank and this update's version (from actor rank 0's
        `prepare`, which verl lists first)."""
        if len(metadata) != actor_wg_world_size + rollout_world_size:
            raise InvalidArgument(
                f"tensorhub checkpoint engine: {len(metadata)} workers prepared, expected "
                f"{actor_wg_world_size} actor + {rollout_world_size} rollout"
            )
        master = metadata[0] if metadata else {}
        if not master.get("is_master") or "version" not in master:
            raise InvalidArgument(
                "tensorhub checkpoint engine: actor rank 0 must be built with is_master=True"
            )
        version = int(master["version"])
        actor: dict[str, list[Any]] = {
            "role": [ACTOR] * actor_wg_world_size,
            "rank": list(range(actor_wg_world_size)),
            "version": [version] * actor_wg_world_size,
        }
        rollout: dict[str, list[Any]] = {
            "role": [ROLLOUT] * rollout_world_size,
            "rank": list(range(rollout_world_size)),
            "version": [version] * rollout_world_size,
        }
        return actor, rollout

    def init_process_group(self, role: str, rank: int, version: int) -> None:
        """No process group: only the role, rank and version of this update are kept. The
        hub client is opened here (if not yet) so the transfer does not pay for it."""
        if role not in (ACTOR, ROLLOUT):
            raise InvalidArgument(f"tensorhub checkpoint engine: unknown role {role!r}")
        self.role, self.rank, self.version = role, int(rank), int(version)
        if role == ROLLOUT or self.is_master:
            _ = self.hub

    def finalize(self) -> None:
        """End of an update. The version stays held and served (the next update releases
        it); only this update's topology is forgotten."""
        self.role, self.rank, self.version = None, None, None

    async def send_weights(
        self, weights: Weights, global_steps: int | None = None
    ) -> dict[str, float]:
        """Publish the stream as this update's version (actor rank 0), or walk it (other
        actor ranks). Returns verl's per-sync metrics, merged into the trainer's."""
        if self.role == ROLLOUT:
            raise InvalidArgument("tensorhub checkpoint engine: a rollout worker cannot send")
        if not self.is_master:
            async for _ in _items(weights):
                pass
            return {}
        start = time.monotonic()
        deadline = start + self.timeout
        staging = await asyncio.to_thread(self._free_publication)
        tensors = await self._gather(weights, staging)
        version = self.version
        publication = await asyncio.to_thread(self._publish, tensors, version, deadline)
        self.publication = publication
        self.last_version = publication.version
        nbytes = sum(t.nbytes for t in tensors.values())
        companion = publication.companion
        encoded = 0 if companion is None else sum(t.nbytes for t in companion.tensors.values())
        log.info(
            "published %s@%d (%d tensors, %.1f MiB, its delta %.1f MiB, global step %s) in %.2fs",
            self.model, publication.version, len(tensors), nbytes / 2**20, encoded / 2**20,
            global_steps, time.monotonic() - start,
        )  # fmt: skip
        return {
            "tensorhub/version": float(publication.version),
            "tensorhub/send_s": time.monotonic() - start,
            "tensorhub/send_mb": nbytes / 2**20,
            "tensorhub/delta_mb": encoded / 2**20,  # 0: no delta (the first, or delta=False)
        }

    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield `(name, tensor)` of this update's version, once all of it has arrived and
        been checked. The tensors are host memory this engine serves to the other rollouts
        until the next update: read them, do not change them."""
        if self.role == ACTOR or self.is_master:
            raise InvalidArgument("tensorhub checkpoint engine: an actor worker cannot receive")
        held = await asyncio.to_thread(self._receive, self.version)
        for name, tensor in held.tensors.items():
            yield name, tensor

    def close(self) -> None:
        """Stop serving everything (forced: the worker is going away) and close the client."""
        handles = [*self._kept, self.publication, self.held]
        self._kept, self.publication, self.held = [], None, None
        try:
            for handle in handles:
                if handle is not None and not handle.released:
                    handle.release(force=True)
        finally:
            with self._lock:
                hub, self._hub = self._hub, None
            if hub is not None and self._owned:
                hub.close()

    # -- sending ------------------------------------------------------------------------

    def _free_publication(self) -> dict[str, torch.Tensor]:
        """Release the previous publication and return its memory for reuse ({} if it has
        to stay served: the last copy of a retained version, past the spill budget)."""
        self._retry_kept()
        previous, self.publication = self.publication, None
        if previous is None:
            return {}
        try:
            previous.release()
        except RetentionViolation:
            log.warning("%r stays served (retained, no spill budget): new staging", previous)
            self._kept.append(previous)
            return {}
        return previous.tensors

    async def _gather(
        self, weights: Weights, staging: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Copy the stream into contiguous host tensors, reusing `staging`'s where the name,
        shape and dtype match."""
        tensors: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            async for name, tensor in _items(weights):
                if name in tensors:
                    raise InvalidArgument(f"tensorhub checkpoint engine: {name!r} sent twice")
                source = tensor.detach()
                target = staging.get(name)
                if target is None or target.shape != source.shape or target.dtype != source.dtype:
                    target = torch.empty(source.shape, dtype=source.dtype, device="cpu")
                target.copy_(source)
                tensors[name] = target
        if not tensors:
            raise InvalidArgument("tensorhub checkpoint engine: no weights to send")
        return tensors

    def _publish(
        self, tensors: dict[str, torch.Tensor], version: int | None, deadline: float
    ) -> Publication:
        hub = self.hub
        remaining = deadline - time.monotonic()
        if version is None:  # driven without build_topology (verl's own engine tests do that)
            version = hub.latest(self.model, timeout=max(remaining, 0.1)) + 1
            remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded(f"{self.model}@{version}: no time left to publish")
        return hub.publish(
            self.model, version, tensors, timeout=remaining, delta=self.delta,
            base_copy=self.base_copy,
        )  # fmt: skip

    # -- receiving ----------------------------------------------------------------------

    def _receive(self, version: int | None) -> Held:
        """Wait for `version` (without a topology: any version newer than the last one
        received), free the previous one's memory and fetch into it, within the deadline:
        that memory holds the previous version, so a delta version moves only its changes
        (`self.held.delta` says what they were)."""
        deadline = time.monotonic() + self.timeout
        hub = self.hub
        wanted = self._wait_for(hub, version, deadline)
        self._retry_kept()
        staging = self._free_held()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded(f"{self.model}@{wanted}: no time left to fetch")
        try:
            held = hub.fetch(self.model, wanted, into=staging, timeout=remaining, delta=self.delta)
        except InvalidArgument:
            if staging is None:
                raise
            log.info("%s@%d has a new layout: fetching into fresh memory", self.model, wanted)
            held = hub.fetch(
                self.model, wanted, timeout=max(deadline - time.monotonic(), 0.1),
                delta=self.delta,
            )  # fmt: skip
        self.held = held
        self.last_version = held.version
        return held

    def _wait_for(self, hub: Hub, version: int | None, deadline: float) -> int:
        """Block until `version` (or, if None, one newer than the last received) is
        published; returns the version to fetch. `DeadlineExceeded` at the deadline."""
        target = version if version is not None else self.last_version + 1

        def ready() -> int | None:
            latest = hub.latest(self.model, timeout=max(deadline - time.monotonic(), 0.1))
            if latest >= target:
                return target if version is not None else latest
            return None

        found = ready()
        if found is not None:
            return found
        with hub.watch(self.model, versions_only=True) as events:
            found = ready()  # published between the first look and the watch
            while found is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceeded(
                        f"{self.model}@{target} not published within {self.timeout:.0f}s"
                    )
                event = events.get(remaining)
                if (
                    event is not None
                    and event.kind in (EventKind.VERSION_PUBLISHED, EventKind.RESYNC)
                    and event.version >= target
                ):
                    found = target if version is not None else event.version
        return found

    def _free_held(self) -> dict[str, torch.Tensor] | None:
        """Release the previously fetched version; its memory, or None if it stays served."""
        previous, self.held = self.held, None
        if previous is None:
            return None
        try:
            previous.release()
        except RetentionViolation:
            log.warning("%r stays served (retained, no spill budget): fresh memory", previous)
            self._kept.append(previous)
            return None
        return previous.tensors

    def _retry_kept(self) -> None:
        still: list[Publication | Held] = []
        for handle in self._kept:
            try:
                handle.release()
            except RetentionViolation:
                still.append(handle)
        self._kept = still


__all__ = ["BACKEND", "DEFAULT_TIMEOUT", "TensorHubCheckpointEngine"]
