"""The actor's side of a `tensorhub` checkpoint engine's update (`ros.integrations.verl`):
with verl's FSDP2 engine, every actor rank publishes its own shard of the DTensor state
behind verl's stream (`ros.integrations.verl_ranks`), the stream closed unwalked; with any
other stream, actor rank 0 copies it into contiguous host tensors it owns and publishes
them as the version. Each frees, first, the memory of the publication before it, reused as
the next version's staging unless it must stay served.

Apart from verl's protocol (`ros.integrations.verl`) and the rollout's side
(`ros.integrations.verl_receive`): what publishes, and the host memory it holds. verl is
not imported here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable

import torch
import torch.distributed as dist

from ros.client.handles import Publication
from ros.integrations.verl_ranks import RankPublish, host_copy, publish_shard
from ros.integrations.verl_shards import ShardedParams
from ros.integrations.verl_state import EngineState
from tensorhub.errors import DeadlineExceeded, InvalidArgument, RetentionViolation

log = logging.getLogger("ros.integrations.verl")  # the backend's records, under one name

Weights = Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]]


async def weight_items(weights: Weights) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """Both kinds of stream verl hands over: a plain generator (`get_per_tensor_param`) or an
    async one (another engine's `receive_weights`), walked on the caller's thread."""
    if isinstance(weights, AsyncIterable):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


class Sending(EngineState):
    """An engine's publishing: `TensorHubCheckpointEngine.send_weights` calls these."""

    async def _send_shard(
        self, weights: ShardedParams, global_steps: int | None
    ) -> dict[str, float]:
        """Every actor rank: publish its own shard of the DTensor state dict behind verl's
        stream, which is closed unwalked (nothing gathered)."""
        start = time.monotonic()
        deadline = start + self.timeout
        state = weights.state()
        weights.close()
        reuse = await asyncio.to_thread(self._free_publication)
        group = dist.group.WORLD if self.group else None
        done: RankPublish = await asyncio.to_thread(
            publish_shard, self.hub, self.model, self.version, state, reuse, group=group,
            delta=self.delta, base_copy=self.base_copy, deadline=deadline,
        )  # fmt: skip
        self.publication = done.publication
        self.last_version = done.version
        companion = None if done.publication is None else done.publication.companion
        encoded = 0 if companion is None else sum(t.nbytes for t in companion.tensors.values())
        seconds = time.monotonic() - start
        log.info(
            "published shard %s of %s@%d (%.1f MiB, its delta %.1f MiB, base copies %.1f MiB, "
            "global step %s) in %.2fs", done.shard, self.model, done.version,
            done.staged_bytes / 2**20, encoded / 2**20, done.base_bytes / 2**20, global_steps,
            seconds,
        )  # fmt: skip
        if not self.is_master:
            return {}  # verl merges the ranks' metrics: rank 0's stand for the update
        return {
            "tensorhub/version": float(done.version),
            "tensorhub/send_s": seconds,
            "tensorhub/send_mb": done.staged_bytes / 2**20,  # this rank's shard
            "tensorhub/delta_mb": encoded / 2**20,
            "tensorhub/shards": float(0 if done.shard is None else done.shard[1]),
        }

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
            async for name, tensor in weight_items(weights):
                if name in tensors:
                    raise InvalidArgument(f"tensorhub checkpoint engine: {name!r} sent twice")
                tensors[name] = host_copy(tensor, staging.get(name))
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
