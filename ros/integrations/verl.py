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
- `send_weights` on every actor rank, with verl's FSDP2 actor (`shards`, on by default):
  each rank publishes its own shard of the FSDP state, the DTensors verl's training engine
  holds, as its shard of the version (`ros.integrations.verl_ranks`), and the ranks' shards
  reach the hub in one call per version over the actor ranks' process group (`group`, on
  by default; off: one call per rank). verl hands `send_weights` a generator that
  all-gathers each tensor as it is walked; `ros.integrations.verl_shards` hooks verl's FSDP
  engine so that the generator also carries the DTensor state dict behind it, and the
  generator is closed unwalked: nothing is gathered, to rank 0 or anywhere. **Memory on
  each actor rank: a host copy of its own shard** (the parameters are live: the next
  optimizer step changes them, while the version must stay as published), reused from one
  version to the next once the previous publication is released.
- Any other stream (verl's Megatron engine, LoRA, QAT, `shards=False`): actor rank 0 copies
  the `(name, tensor)` stream into contiguous host tensors it owns (the stream's tensors are
  transient: FSDP gathers each one and frees it), and publishes them as one version; the
  other actor ranks only walk the stream (producing it is collective over the actor group).
  Memory: one host copy of the full model on rank 0.
- `receive_weights` waits for the version (a `versions_only` watch, deadline-bound), then
  reads it into the memory of the version before and only then yields `(name, tensor)`
  pairs: a fetch that fails yields nothing, so the engine never loads a mix of two versions.
  A version of shards is read into whole tensors (`ros.integrations.verl_read`): with
  FSDP2's shards (runs of whole rows), rollout `r` fetches shard `r mod N` as its holder
  straight into the rows it holds and reads the others' rows with `fetch_slices`; any other
  layout is read by `fetch_slices` alone. What a rollout holds (a whole version, or its
  shard) stays served to the other rollouts until the next update. **With fewer rollouts
  than actor ranks**, a shard that no rollout holds has only its rank as holder: the hub
  retains the version before (2 by default), so the rank's release of it spills a host
  copy of its shard (`ros.client.retention`), one more shard on that rank.
- Every wait has a deadline (`timeout`), and every failure is a named `tensorhub` error.
- Delta versions (`delta`, on by default): the publishing ranks publish with `delta=True`,
  keeping a copy of what they published (`base_copy`: "host" memory by default) so that
  each next version is also published as its changes, shard by shard, and each rollout
  reads only those changes (checked against the base chunk by chunk, verified after, whole
  where a check fails). **Memory: one more host copy of what the rank published**: its own
  shard on each actor rank (the full model on rank 0 for a gathered stream), plus the
  encoded changes while they are served. A rollout needs none for what it holds (its own
  copy is the base); for what it reads by `fetch_slices` the SDK keeps a staging copy of
  each source shard as the base of the next read (up to one more copy of the model).
  `delta=False` keeps no copy and reads every version whole.

In verl's config (engine kwargs reach the constructor; the module is imported on every worker
before the backend is built):

    actor_rollout_ref.rollout.checkpoint_engine.backend=tensorhub
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=ros.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.tensorhub.hub=10.0.0.1:7600
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.tensorhub.model=policy

`shards=False` (`...engine_kwargs.tensorhub.shards=false`) turns the per-rank publish off,
and `group=False` sends one hub call per actor rank instead of one per version. The hook
into verl's FSDP engine is checked against verl's version when an actor's engine is built
(`ros.integrations.verl_shards.VERL_VERSIONS`): another verl fails there, loudly, until it
is checked or `shards=False` is passed.

`hub`, `tenant` and `token` default to `TENSORHUB_HUB`, `TENSORHUB_TENANT` and
`TENSORHUB_TOKEN` in the workers' environment (keep the token out of the config).
This module imports verl (and Ray): only import it where verl is installed.

This module is verl's protocol (prepare, build_topology, init_process_group, send_weights,
receive_weights, finalize, close) and the backend's registration. The engine's
configuration, hub client and served handles are `ros.integrations.verl_state`; the actor's
publishing, `ros.integrations.verl_send`; the rollout's reading,
`ros.integrations.verl_receive`: none of those imports verl.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry

from ros.integrations.verl_receive import Receiving
from ros.integrations.verl_send import Sending, Weights, weight_items
from ros.integrations.verl_shards import ShardedParams
from ros.integrations.verl_state import DEFAULT_TIMEOUT
from tensorhub.errors import InvalidArgument

log = logging.getLogger(__name__)

BACKEND = "tensorhub"
"""The name this backend is registered under (`checkpoint_engine.backend`)."""

ACTOR, ROLLOUT = "actor", "rollout"


@CheckpointEngineRegistry.register(BACKEND)
class TensorHubCheckpointEngine(Sending, Receiving, CheckpointEngine):  # type: ignore[misc]  # verl is untyped (Any)
    """verl checkpoint engine that moves each weight update through TensorHub.

    Built by verl with `bucket_size` (unused: the hub chunks versions itself) and, on actor
    workers, `is_master` (True on actor rank 0, which picks each version; given at all: an
    actor); every other argument comes from `checkpoint_engine.engine_kwargs.tensorhub`
    (`delta=False` turns delta versions off: no base copies, whole fetches; `shards` and
    `group`: the module docstring). One hub client per engine (per worker process), opened
    on first use and kept across updates so that what it holds stays served; `client`, when
    given (code that builds the engine itself, tests), is used instead and left open by
    `close()`.
    """

    wire_format = "named_tensors"

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
        if role == ROLLOUT or self.is_master or self.shards:
            _ = self.hub

    def finalize(self) -> None:
        """End of an update. The version stays held and served (the next update releases
        it); only this update's topology is forgotten."""
        self.role, self.rank, self.version = None, None, None

    async def send_weights(
        self, weights: Weights, global_steps: int | None = None
    ) -> dict[str, float]:
        """Publish this rank's shard of the version (every actor rank, from verl's FSDP2
        engine: `ShardedParams`), or publish the stream as this update's version (actor rank
        0; the other actor ranks walk it). Returns verl's per-sync metrics, merged into the
        trainer's: actor rank 0's (its own shard's, for a version of shards)."""
        if self.role == ROLLOUT:
            raise InvalidArgument("tensorhub checkpoint engine: a rollout worker cannot send")
        if self.shards and isinstance(weights, ShardedParams):
            return await self._send_shard(weights, global_steps)
        if not self.is_master:
            async for _ in weight_items(weights):
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
        tensors = await asyncio.to_thread(self._receive, self.version)
        for name, tensor in tensors.items():
            yield name, tensor

    def close(self) -> None:
        """Stop serving everything (forced: the worker is going away) and close the client."""
        read = self.shards_read
        handles = [*self._kept, self.publication, self.held, *(read.held if read else [])]
        self._kept, self.publication, self.held, self.shards_read = [], None, None, None
        try:
            for handle in handles:
                if handle is not None and not handle.released:
                    handle.release(force=True)
        finally:
            with self._lock:
                hub, self._hub = self._hub, None
            if hub is not None and self._owned:
                hub.close()


__all__ = ["BACKEND", "DEFAULT_TIMEOUT", "TensorHubCheckpointEngine"]
