"""Explicit limits on the streams one hub replica serves, enforced before any work is done.

A KeepAlive or Watch stream costs the replica memory (a coroutine, a queue), not a thread, so
a replica holds thousands of them (DESIGN §8: 2,000 clients, each a session keepalive and a
versions-only watch, on 2 cores). The limits keep that memory bounded and keep one tenant
from taking every slot: past a limit a new stream fails at once with `Overloaded`
(RESOURCE_EXHAUSTED) naming the limit, and the SDK backs off with jitter and retries.
Private watch replays (a start revision older than the shared watch has passed) each need
their own etcd watch and threads, so they have a smaller limit of their own.

Counts and limits are exported as Prometheus metrics (`ros.metrics`). One `StreamLimits`
belongs to one replica; its counters are only touched under its lock, so it may be used from
the event loop and from worker threads alike.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ros.metrics import HUB_STREAM_LIMIT, HUB_STREAMS_ACTIVE, HUB_STREAMS_REFUSED
from tensorhub.errors import InvalidArgument, Overloaded

DEFAULT_MAX_STREAMS = 16_384
DEFAULT_MAX_STREAMS_PER_TENANT = 8_192
DEFAULT_MAX_PRIVATE_WATCHES = 64
DEFAULT_WORKERS = 16


@dataclass(frozen=True)
class Limits:
    """The sizes a replica enforces (defaults sized for DESIGN §8 with room to spare)."""

    max_streams: int = DEFAULT_MAX_STREAMS
    max_streams_per_tenant: int = DEFAULT_MAX_STREAMS_PER_TENANT
    max_private_watches: int = DEFAULT_MAX_PRIVATE_WATCHES
    workers: int = DEFAULT_WORKERS

    def __post_init__(self) -> None:
        for name in ("max_streams", "max_streams_per_tenant", "max_private_watches", "workers"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be at least 1, got {getattr(self, name)}")


class StreamLimits:
    """Counts of open streams (in all, per tenant, private replays) against `Limits`."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._total = 0
        self._private = 0
        self._by_tenant: dict[str, int] = {}
        HUB_STREAM_LIMIT.labels("replica").set(limits.max_streams)
        HUB_STREAM_LIMIT.labels("tenant").set(limits.max_streams_per_tenant)
        HUB_STREAM_LIMIT.labels("private_watch").set(limits.max_private_watches)

    def active(self, tenant: str | None = None) -> int:
        """Streams open now, in all or of one tenant."""
        with self._lock:
            return self._total if tenant is None else self._by_tenant.get(tenant, 0)

    @contextmanager
    def stream(self, kind: str, tenant: str) -> Iterator[None]:
        """Hold one stream slot of `kind` ("keepalive", "watch") for `tenant` while inside;
        `Overloaded` at once if the replica or the tenant is at its limit."""
        with self._lock:
            if self._total >= self.limits.max_streams:
                HUB_STREAMS_REFUSED.labels("replica").inc()
                raise Overloaded(
                    f"this hub replica serves its limit of {self.limits.max_streams} streams "
                    "(--max-streams); retry later or use another replica"
                )
            held = self._by_tenant.get(tenant, 0)
            if held >= self.limits.max_streams_per_tenant:
                HUB_STREAMS_REFUSED.labels("tenant").inc()
                raise Overloaded(
                    f"tenant {tenant} has its limit of {self.limits.max_streams_per_tenant} "
                    "streams open on this hub replica (--max-streams-per-tenant)"
                )
            self._total += 1
            self._by_tenant[tenant] = held + 1
        HUB_STREAMS_ACTIVE.labels(kind).inc()
        try:
            yield
        finally:
            HUB_STREAMS_ACTIVE.labels(kind).dec()
            with self._lock:
                self._total -= 1
                left = self._by_tenant[tenant] - 1
                if left:
                    self._by_tenant[tenant] = left
                else:
                    del self._by_tenant[tenant]

    def acquire_private(self) -> None:
        """Take one private replay slot, or `Overloaded` if all are in use."""
        with self._lock:
            if self._private >= self.limits.max_private_watches:
                HUB_STREAMS_REFUSED.labels("private_watch").inc()
                raise Overloaded(
                    f"this hub replica replays its limit of {self.limits.max_private_watches} "
                    "watches from old revisions at once (--max-private-watches); retry later"
                )
            self._private += 1
        HUB_STREAMS_ACTIVE.labels("private_watch").inc()

    def release_private(self) -> None:
        """Give back a slot taken by `acquire_private`."""
        with self._lock:
            self._private -= 1
        HUB_STREAMS_ACTIVE.labels("private_watch").dec()
