"""What one `tensorhub` checkpoint engine is built with and keeps from one update to the
next (`ros.integrations.verl`): its `engine_kwargs` (the hub, tenant and token default to
`TENSORHUB_HUB`, `TENSORHUB_TENANT` and `TENSORHUB_TOKEN`), its hub client (opened on first
use, kept across updates so that what it holds stays served), this update's role, rank and
version, and what it serves (the last publication or fetch, and those kept serving because
releasing them would drop a retained version).

Apart from verl's protocol (`ros.integrations.verl`, which imports verl) and from the
actor's and the rollout's sides of an update, which both read and change this state: the
one place an engine's attributes are made. verl is not imported here.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import ros
from ros.client.handles import Held, Publication
from ros.client.hub import Hub
from ros.integrations import verl_shards
from ros.integrations.verl_read import ShardsRead
from tensorhub.errors import InvalidArgument, RetentionViolation

DEFAULT_TIMEOUT = 300.0
"""Seconds one `send_weights` or `receive_weights` may take, waits and transfer included."""


def _env(value: str | None, name: str, what: str) -> str:
    found = value or os.environ.get(name)
    if not found:
        raise InvalidArgument(f"tensorhub checkpoint engine: no {what}: pass it or set {name}")
    return found


class EngineState:
    """An engine's configuration, its hub client and what it serves
    (`TensorHubCheckpointEngine`'s arguments: its docstring)."""

    def __init__(
        self,
        bucket_size: int = 0,
        is_master: bool | None = None,
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
        shards: bool = True,
        group: bool = True,
        client: Hub | None = None,
    ) -> None:
        self.bucket_size = bucket_size
        self.is_master = bool(is_master)
        self.shards = bool(shards)  # every actor rank publishes its own shard (FSDP2)
        self.group = bool(group)  # ... in one hub call per version over the actor ranks
        if self.shards and is_master is not None:  # an actor: hook verl's FSDP engine
            verl_shards.install()
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
        self.shards_read: ShardsRead | None = None  # a version of shards, read whole
        self._kept: list[Publication | Held] = []
        self.last_version = 0

    @property
    def hub(self) -> Hub:
        """This worker's hub client, connected on first use."""
        with self._lock:
            if self._hub is None:
                self._hub = ros.connect(
                    self._endpoints, tenant=self._tenant, token=self._token, **self._options
                )
            return self._hub

    def _retry_kept(self) -> None:
        still: list[Publication | Held] = []
        for handle in self._kept:
            try:
                handle.release()
            except RetentionViolation:
                still.append(handle)
        self._kept = still
