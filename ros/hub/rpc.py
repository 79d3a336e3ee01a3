"""What every hub handler shares: error mapping decorators, authentication, deadlines,
and the registries confined to the caller's tenant.

Every handler runs under a deadline (the caller's, capped at `MAX_CALL_SECONDS`), maps errors
through `ros.errors`, and answers with the etcd revision it read or wrote at. The hub keeps
no state of its own beyond caches: any replica can serve any call.
"""

from __future__ import annotations

import functools
import hmac
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from consistency import Etcd, HolderRegistry, Keys, VersionRegistry
from ros.errors import ERROR_METADATA_KEY, status_of
from ros.hub.fanout import WatchFanout
from ros.hub.tenants import Tenant, TenantStore
from ros.metrics import HUB_LATENCY, HUB_REQUESTS
from tensorhub.errors import DeadlineExceeded, PermissionDenied, SessionExpired, TensorHubError

log = logging.getLogger(__name__)

MAX_CALL_SECONDS = 30.0
F = TypeVar("F", bound=Callable[..., Any])


def _abort(context: grpc.ServicerContext, method: str, exc: TensorHubError) -> None:
    code = status_of(exc)
    HUB_REQUESTS.labels(method, code.name).inc()
    log.info("rpc %s failed: %s: %s", method, type(exc).__name__, exc)
    context.set_trailing_metadata(((ERROR_METADATA_KEY, type(exc).__name__),))
    context.abort(code, str(exc))


def unary(fn: F) -> F:
    """Wrap a unary handler: timing, status metrics, error mapping."""

    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        start = time.monotonic()
        try:
            response = fn(self, request, context)
        except TensorHubError as exc:
            _abort(context, fn.__name__, exc)
        HUB_REQUESTS.labels(fn.__name__, "OK").inc()
        HUB_LATENCY.labels(fn.__name__).observe(time.monotonic() - start)
        return response

    return wrapper  # type: ignore[return-value]


def streaming(fn: F) -> F:
    """Wrap a streaming handler (a generator) with the same error mapping."""

    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from fn(self, request, context)
        except TensorHubError as exc:
            _abort(context, fn.__name__, exc)

    return wrapper  # type: ignore[return-value]


class HubBase:
    """State and plumbing shared by the handler groups (sessions, versions, holders)."""

    def __init__(self, etcd: Etcd, keys: Keys, *, default_retain: int = 2) -> None:
        self.etcd = etcd
        self.keys = keys
        self.tenants = TenantStore(etcd, keys)
        self._default_retain = default_retain
        # Retention runs after a publish has answered, off the publisher's critical path.
        self._collector = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retention")
        self._fanout = WatchFanout(etcd, keys)
        self.tenants.hub_secret()  # create it at start-up, not in the first caller's deadline

    def close(self) -> None:
        """Stop the background retention worker (pending collections are dropped: the next
        publish of each model runs its retention again) and the shared watches."""
        self._collector.shutdown(wait=False, cancel_futures=True)
        self._fanout.close()

    def _tenant(self, context: grpc.ServicerContext) -> Tenant:
        token = bearer(context)
        if token is None:
            raise PermissionDenied("no tenant token: send 'authorization: Bearer <token>'")
        return self.tenants.authenticate(token)

    @staticmethod
    def _timeout(context: grpc.ServicerContext) -> float:
        remaining = context.time_remaining()
        if remaining is None:
            return MAX_CALL_SECONDS
        if remaining <= 0:
            raise DeadlineExceeded("the call's deadline passed before the hub could act")
        return min(remaining, MAX_CALL_SECONDS)

    def _versions(self, tenant: Tenant) -> VersionRegistry:
        retain = min(self._default_retain, tenant.quotas.max_retained_versions)
        return VersionRegistry(self.etcd, self.keys, retain=retain, collector=self._collector)

    def _holders(self, tenant: Tenant) -> HolderRegistry:
        return HolderRegistry(self._versions(tenant))

    def _own_session(self, tenant: Tenant, session_id: int, timeout: float) -> None:
        """Refuse to attach records to a lease that is not one of this tenant's sessions.

        A lease that no longer exists at all is the caller's own expired (or revoked) session
        as far as it can tell: `SessionExpired` (a `LeaseLost`) says so, and that it must open
        a new one. A live lease that is not this tenant's is `PermissionDenied`.
        """
        kv, _ = self.etcd.get(self.keys.session(tenant.name, session_id), timeout=timeout)
        if kv is not None:
            return
        if self.etcd.lease_ttl(session_id, timeout=timeout) < 0:
            raise SessionExpired(
                f"session {session_id:x} has expired or was revoked: open a new one"
            )
        raise PermissionDenied(f"session {session_id:x} is not an open session of this tenant")


def bearer(context: grpc.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata():
        if key == "authorization":
            text = value if isinstance(value, str) else value.decode()
            if text.startswith("Bearer "):
                return text[len("Bearer ") :].strip()
    return None


def same(a: str, b: str) -> bool:
    return hmac.compare_digest(a, b)
