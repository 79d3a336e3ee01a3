"""Explicit limits on the streams one hub replica serves, enforced before any work is done.

A KeepAlive or Watch stream costs the replica memory (a coroutine, a queue), not a thread, so
a replica holds thousands of them (docs/design.md, "Scale envelope": 2,000 clients, each a
session keepalive and a
versions-only watch, on 2 cores). The limits keep that memory bounded and keep one tenant
from taking every slot: past a limit a new stream fails at once with `Overloaded`
(RESOURCE_EXHAUSTED) naming the limit, and the SDK backs off with jitter and retries.
Every watched model costs the replica an etcd watcher on its one multiplexed etcd stream
(`ros.hub.model_feed`), whether it is ever published or not, so the distinct models one tenant
watches at once are bounded too (`max_watched_models_per_tenant`): many streams on one model
cost one watcher, but a stream per made-up name would otherwise cost one each. Private watch
replays (a start revision older than the shared watch has passed) each make etcd replay
history, so they have a smaller limit of their own, per replica and per tenant.

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
DEFAULT_MAX_PRIVATE_WATCHES_PER_TENANT = 16
# A tenant's default model quota is 64 (`ros.hub.tenants`); watching a name before its first
# publish is normal, so the bound leaves room for many more names than a tenant publishes.
DEFAULT_MAX_WATCHED_MODELS_PER_TENANT = 1_024
DEFAULT_WORKERS = 16
# processes checking group calls' manifests beside a replica (`ros.hub.manifest_processes`);
# `tensorhub serve` starts one, a replica built in a process of its own (a test) none
DEFAULT_CHECK_PROCESSES = 0


@dataclass(frozen=True)
class Limits:
    """The sizes a replica enforces (defaults sized for docs/design.md's scale envelope,
    with room to spare)."""

    max_streams: int = DEFAULT_MAX_STREAMS
    max_streams_per_tenant: int = DEFAULT_MAX_STREAMS_PER_TENANT
    max_private_watches: int = DEFAULT_MAX_PRIVATE_WATCHES
    workers: int = DEFAULT_WORKERS
    max_private_watches_per_tenant: int = DEFAULT_MAX_PRIVATE_WATCHES_PER_TENANT
    max_watched_models_per_tenant: int = DEFAULT_MAX_WATCHED_MODELS_PER_TENANT
    check_processes: int = DEFAULT_CHECK_PROCESSES

    def __post_init__(self) -> None:
        if self.check_processes < 0:
            raise InvalidArgument(f"check_processes must be 0 or more, got {self.check_processes}")
        for name in (
            "max_streams",
            "max_streams_per_tenant",
            "max_private_watches",
            "workers",
            "max_private_watches_per_tenant",
            "max_watched_models_per_tenant",
        ):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be at least 1, got {getattr(self, name)}")


class StreamLimits:
    """Counts of open streams (in all, per tenant), of the models each tenant watches and of
    private replays (in all, per tenant) against `Limits`."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._total = 0
        self._private = 0
        self._by_tenant: dict[str, int] = {}
        self._private_by_tenant: dict[str, int] = {}
        # tenant -> model -> Watch streams of it open on this replica
        self._watched: dict[str, dict[str, int]] = {}
        HUB_STREAM_LIMIT.labels("replica").set(limits.max_streams)
        HUB_STREAM_LIMIT.labels("tenant").set(limits.max_streams_per_tenant)
        HUB_STREAM_LIMIT.labels("private_watch").set(limits.max_private_watches)
        HUB_STREAM_LIMIT.labels("private_watch_tenant").set(limits.max_private_watches_per_tenant)
        HUB_STREAM_LIMIT.labels("watched_models").set(limits.max_watched_models_per_tenant)

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

    def watched(self, tenant: str) -> int:
        """Distinct models `tenant` watches on this replica now."""
        with self._lock:
            return len(self._watched.get(tenant, ()))

    @contextmanager
    def watch_model(self, tenant: str, model: str) -> Iterator[None]:
        """Count one Watch stream of `tenant` on `model` while inside; `Overloaded` at once if
        `model` is not watched by the tenant yet and the tenant already watches its limit of
        distinct models on this replica (more streams on a model it watches are free here:
        they share its etcd watcher)."""
        with self._lock:
            models = self._watched.setdefault(tenant, {})
            if model not in models and len(models) >= self.limits.max_watched_models_per_tenant:
                if not models:
                    del self._watched[tenant]
                HUB_STREAMS_REFUSED.labels("watched_models").inc()
                raise Overloaded(
                    f"tenant {tenant} watches its limit of "
                    f"{self.limits.max_watched_models_per_tenant} distinct models on this hub "
                    "replica (--max-watched-models-per-tenant); close a watch first"
                )
            models[model] = models.get(model, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                models = self._watched[tenant]
                left = models[model] - 1
                if left:
                    models[model] = left
                else:
                    del models[model]
                    if not models:
                        del self._watched[tenant]

    def acquire_private(self, tenant: str) -> None:
        """Take one private replay slot for `tenant`, or `Overloaded` if the replica's or
        the tenant's are all in use."""
        with self._lock:
            if self._private >= self.limits.max_private_watches:
                HUB_STREAMS_REFUSED.labels("private_watch").inc()
                raise Overloaded(
                    f"this hub replica replays its limit of {self.limits.max_private_watches} "
                    "watches from old revisions at once (--max-private-watches); retry later"
                )
            held = self._private_by_tenant.get(tenant, 0)
            if held >= self.limits.max_private_watches_per_tenant:
                HUB_STREAMS_REFUSED.labels("private_watch_tenant").inc()
                raise Overloaded(
                    f"tenant {tenant} replays its limit of "
                    f"{self.limits.max_private_watches_per_tenant} watches from old revisions "
                    "at once on this hub replica (--max-private-watches-per-tenant); retry later"
                )
            self._private += 1
            self._private_by_tenant[tenant] = held + 1
        HUB_STREAMS_ACTIVE.labels("private_watch").inc()

    def release_private(self, tenant: str) -> None:
        """Give back a slot taken by `acquire_private(tenant)`."""
        with self._lock:
            self._private -= 1
            left = self._private_by_tenant[tenant] - 1
            if left:
                self._private_by_tenant[tenant] = left
            else:
                del self._private_by_tenant[tenant]
        HUB_STREAMS_ACTIVE.labels("private_watch").dec()
