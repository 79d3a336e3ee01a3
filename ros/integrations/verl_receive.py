"""The rollout's side of a `tensorhub` checkpoint engine's update (`ros.integrations.verl`):
wait for this update's version (a `versions_only` watch, within the deadline), free the
memory of the version read before, and read the new one into it, so that a delta version
moves only its changes; a version of shards is read into whole tensors
(`ros.integrations.verl_read`).

Apart from verl's protocol (`ros.integrations.verl`) and the actor's side
(`ros.integrations.verl_send`): what reads, and the memory it reads into. verl is not
imported here.
"""

from __future__ import annotations

import logging
import time

import torch

from consistency.events import EventKind
from ros.client.hub import Hub
from ros.integrations.verl_read import read_shards
from ros.integrations.verl_state import EngineState
from tensorhub.errors import DeadlineExceeded, InvalidArgument, RetentionViolation

log = logging.getLogger("ros.integrations.verl")  # the backend's records, under one name


class Receiving(EngineState):
    """An engine's reads: `TensorHubCheckpointEngine.receive_weights` calls these."""

    def _receive(self, version: int | None) -> dict[str, torch.Tensor]:
        """Wait for `version` (without a topology: any version newer than the last one
        received), free the previous one's memory and read into it, within the deadline:
        that memory holds the previous version, so a delta version moves only its changes
        (`Held.delta` says what they were: `self.held`, or each of `self.shards_read.held`)."""
        deadline = time.monotonic() + self.timeout
        hub = self.hub
        wanted = self._wait_for(hub, version, deadline)
        self._retry_kept()
        staging = self._free_held()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded(f"{self.model}@{wanted}: no time left to fetch")
        resolved = hub.resolve(self.model, wanted, timeout=remaining)
        if resolved.shards:
            self.shards_read = read_shards(
                hub, self.model, wanted, resolved, staging or {}, rank=self.rank or 0,
                base=self.last_version if staging else None, delta=self.delta,
                deadline=deadline,
            )  # fmt: skip
            self.last_version = wanted
            return self.shards_read.tensors
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
        return held.tensors

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
        """Release the version read before (whole, or its shards); its memory, or None if
        any of it stays served."""
        previous, self.held = self.held, None
        read, self.shards_read = self.shards_read, None
        handles = [previous] if previous is not None else (read.held if read else [])
        kept = False
        for handle in handles:
            try:
                handle.release()
            except RetentionViolation:
                log.warning("%r stays served (retained, no spill budget): fresh memory", handle)
                self._kept.append(handle)
                kept = True
        if kept:
            return None
        if previous is not None:
            return previous.tensors
        return None if read is None else read.tensors
