"""What every hub handler shares: the call snapshot, error mapping decorators,
authentication, deadlines, and the registries confined to the caller's tenant.

The hub serves on `grpc.aio` (see `ros.hub.server`): streams are coroutines, so they cost
memory, not threads. Unary handler bodies stay synchronous (they call the blocking etcd
client); `unary` runs each in ONE bounded worker pool, handing it a `CallContext` (the
call's metadata and deadline, read once on the event loop) instead of the aio context, which
must not be touched from another thread. A call whose deadline has passed by the time it
would run is refused, not run.

Every handler runs under a deadline (the caller's, capped at `MAX_CALL_SECONDS`), maps errors
through `ros.errors` (the class name travels in the `tensorhub-error` trailing metadata; an
unexpected exception is logged and answered INTERNAL), and answers with the etcd revision it
read or wrote at. The hub keeps no state of its own beyond caches: any replica can serve any
call.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc.aio

from consistency import Etcd, HolderRegistry, Keys, VersionRegistry
from consistency.keepalive import LeaseKeeper
from consistency.usage import DEFAULT_HISTORY_PERIOD, UsageCache
from ros.errors import error_metadata, status_of
from ros.hub.fanout import WatchFanout
from ros.hub.holder_index import HolderIndex
from ros.hub.limits import Limits, StreamLimits
from ros.hub.manifest_cache import ManifestCache
from ros.hub.session_marks import SessionMarks
from ros.hub.shard_publish import ShardBatches
from ros.hub.tenants import Tenant, TenantStore
from ros.metrics import HUB_INTERNAL_ERRORS, HUB_LATENCY, HUB_REQUESTS
from ros.tokens import MAX_READ_TOKEN_LIFETIME, READ_KEY_PERIOD, READ_TOKEN_TTL
from tensorhub.errors import (
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    PermissionDenied,
    SessionExpired,
    StorageFull,
    TensorHubError,
)
from tensorhub.lru import SizedLru

log = logging.getLogger(__name__)

MAX_CALL_SECONDS = 30.0
DEFAULT_ETCD_QUOTA_BYTES = 2 << 30  # etcd's own default --quota-backend-bytes
TENANT_METADATA_KEY = "tensorhub-tenant"  # the tenant a client names (checked against its token)
MAX_OPENED_SESSIONS = 65_536  # session ids remembered per replica (see `opened_sessions`)
S = TypeVar("S", bound="HubBase")
Req = TypeVar("Req")
Resp = TypeVar("Resp")
T = TypeVar("T")
AioContext = grpc.aio.ServicerContext[Any, Any]


class CallContext:
    """What a synchronous handler body may know of its call: the invocation metadata and
    the deadline, snapshotted on the event loop (the aio context is not thread-safe).

    It answers `invocation_metadata()` and `time_remaining()` like a gRPC context does, so
    `bearer`, `HubBase._tenant` and `HubBase._timeout` read it the same way.
    """

    def __init__(self, metadata: Sequence[tuple[str, str | bytes]], deadline: float | None):
        self.metadata = tuple(metadata)
        self.deadline = deadline  # time.monotonic() at which the caller gives up; None: never

    @classmethod
    def of(cls, context: AioContext) -> CallContext:
        """Snapshot an aio context (call on the event loop)."""
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        metadata = [(m[0], m[1]) for m in context.invocation_metadata() or ()]
        return cls(metadata, deadline)

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self.metadata

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()


async def _abort(context: AioContext, method: str, exc: TensorHubError) -> None:
    code = status_of(exc)
    HUB_REQUESTS.labels(method, code.name).inc()
    log.info("rpc %s failed: %s: %s", method, type(exc).__name__, exc)
    context.set_trailing_metadata(error_metadata(exc))  # its name, and fields if it has any
    await context.abort(code, str(exc))


def _internal(method: str, exc: Exception) -> InternalError:
    HUB_INTERNAL_ERRORS.inc()
    log.error("rpc %s failed unexpectedly", method, exc_info=exc)
    return InternalError(f"internal error in {method}: {type(exc).__name__}")


def unary(
    fn: Callable[[S, Req, CallContext], Resp],
) -> Callable[[S, Req, AioContext], Coroutine[Any, Any, Resp]]:
    """Make a synchronous handler body an aio handler: run it in the replica's bounded
    worker pool with a `CallContext`; timing, status metrics, error mapping."""

    async def body(self: S, request: Req, call: CallContext) -> Resp:
        return await self._blocking(fn, self, request, call, deadline_of=call)

    return functools.wraps(fn)(_answered(fn.__name__, body))


def unary_async(
    fn: Callable[[S, Req, CallContext], Coroutine[Any, Any, Resp]],
) -> Callable[[S, Req, AioContext], Coroutine[Any, Any, Resp]]:
    """`unary` for a handler body that is a coroutine: it runs on the event loop and hands
    its blocking parts to the worker pool itself (`HubBase._blocking`), so that while it
    waits (for a group commit: `ros.hub.group_commit`) it holds no worker."""
    return functools.wraps(fn)(_answered(fn.__name__, fn))


def _answered(
    name: str, body: Callable[[S, Req, CallContext], Coroutine[Any, Any, Resp]]
) -> Callable[[S, Req, AioContext], Coroutine[Any, Any, Resp]]:
    """The aio handler around `body`: timing, status metrics, error mapping."""

    async def wrapper(self: S, request: Req, context: AioContext) -> Resp:
        start = time.monotonic()
        call = CallContext.of(context)
        error: TensorHubError
        try:
            response = await body(self, request, call)
        except StorageFull as exc:  # etcd's NOSPACE: tell health now, not at the next check
            self.on_storage_full()
            error = exc
        except TensorHubError as exc:
            error = exc
        except Exception as exc:  # a bug: answered INTERNAL, not UNKNOWN
            error = _internal(name, exc)
        else:
            HUB_REQUESTS.labels(name, "OK").inc()
            HUB_LATENCY.labels(name).observe(time.monotonic() - start)
            return response
        await _abort(context, name, error)
        raise error  # not reached: abort raises

    return wrapper


def streaming(
    fn: Callable[[S, Req, AioContext], AsyncGenerator[Resp, None]],
) -> Callable[[S, Req, AioContext], AsyncGenerator[Resp, None]]:
    """Wrap a streaming handler (an async generator) with the same error mapping. The
    handler is closed as soon as its stream ends (cancelled, or the client went away), so
    its `finally` blocks give back stream slots at once, not when it is garbage-collected."""

    @functools.wraps(fn)
    async def wrapper(self: S, request: Req, context: AioContext) -> AsyncGenerator[Resp, None]:
        error: TensorHubError
        stream = fn(self, request, context)
        try:
            async for item in stream:
                yield item
            return
        except TensorHubError as exc:
            error = exc
        except Exception as exc:  # a bug: answered INTERNAL, not UNKNOWN
            error = _internal(fn.__name__, exc)
        finally:
            await stream.aclose()
        await _abort(context, fn.__name__, error)

    return wrapper


class HubBase:
    """State and plumbing shared by the handler groups (sessions, versions, holders)."""

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        *,
        default_retain: int = 2,
        limits: Limits | None = None,
        read_key_period: float = READ_KEY_PERIOD,
        read_token_ttl: float = READ_TOKEN_TTL,
        history_period: float = DEFAULT_HISTORY_PERIOD,
        etcd_quota_bytes: int = DEFAULT_ETCD_QUOTA_BYTES,
    ) -> None:
        """`history_period`: the compactor's interval, over which each tenant's etcd
        history budget refills; `etcd_quota_bytes`: etcd's `--quota-backend-bytes`, which
        CreateTenant checks the tenants' budgets against."""
        if not 0 < read_token_ttl <= MAX_READ_TOKEN_LIFETIME:  # holders refuse longer ones
            raise InvalidArgument(
                f"read token TTL must be in (0, {MAX_READ_TOKEN_LIFETIME:g}] s, "
                f"got {read_token_ttl}"
            )
        self.read_token_ttl = read_token_ttl  # what Resolve issues (fetches renew: sdk.md)
        self.history_period = history_period if history_period > 0 else DEFAULT_HISTORY_PERIOD
        # Called (on the event loop) when a call was refused for etcd's NOSPACE; the server
        # points it at its compactor, which owns the writes health state.
        self.on_storage_full: Callable[[], None] = lambda: None
        self.etcd_quota_bytes = etcd_quota_bytes
        self.etcd = etcd
        self.keys = keys
        self.tenants = TenantStore(etcd, keys, read_key_period=read_key_period)
        self._default_retain = default_retain
        self.limits = limits or Limits()
        self.streams = StreamLimits(self.limits)
        # Every blocking handler body runs here: a fixed number of threads, whatever the load.
        self._workers = ThreadPoolExecutor(
            max_workers=self.limits.workers, thread_name_prefix="hub-worker"
        )
        # Retention runs after a publish has answered, off the publisher's critical path.
        self._collector = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retention")
        # The usage keys as this replica last read or wrote them: a publish charges its
        # tenant's budget against them with no read (`consistency.usage.UsageCache`).
        self.usage_cache = UsageCache()
        self._fanout = WatchFanout(etcd, keys, self.streams)
        self._leases = LeaseKeeper(etcd)
        # Resolve's view of who holds what (caches only: see ros.hub.holder_index).
        self._holder_index = HolderIndex(etcd, keys)
        self._manifest_cache = ManifestCache()
        # Shard publishes of one version waiting at once commit in one transaction; so do
        # the session marks of one tenant opening at once (a herd of clients). Their
        # transactions run on threads of their own, never queued behind the calls whose
        # writes they carry (one in flight per version or tenant).
        self._committers = ThreadPoolExecutor(
            max_workers=self.limits.workers, thread_name_prefix="hub-commit"
        )
        self.shard_batches = ShardBatches(etcd, keys, self._committers, self.history_period)
        self.session_marks = SessionMarks(etcd, keys, self._committers, self._etcd_for)
        # Sessions this replica opened, by id: their tenant is known without an etcd read
        # (a lease never changes tenant), so their first renewal costs no worker. Bounded.
        self.opened_sessions: SizedLru[int, str] = SizedLru(MAX_OPENED_SESSIONS, lambda _: 1)
        self.tenants.hub_secret()  # create it at start-up, not in the first caller's deadline
        # Each replica follows the tenant records, so a deleted tenant's cached tokens are
        # dropped at once (writes are fenced in etcd regardless: TenantStore.fence).
        self._stop_tenant_watch = threading.Event()
        threading.Thread(
            target=self.tenants.watch, args=(self._stop_tenant_watch,),
            name="tenant-records", daemon=True,
        ).start()  # fmt: skip

    def close(self) -> None:
        """Stop the workers, the background retention worker (pending collections are
        dropped: the next publish of each model runs its retention again), the shared
        watches and the lease keepalive stream."""
        self._stop_tenant_watch.set()
        self._workers.shutdown(wait=False, cancel_futures=True)
        self._committers.shutdown(wait=False, cancel_futures=True)
        self._collector.shutdown(wait=False, cancel_futures=True)
        self._fanout.close()
        self._leases.close()
        self._holder_index.close()

    async def _blocking(
        self, fn: Callable[..., T], *args: Any, deadline_of: CallContext | None = None
    ) -> T:
        """Run `fn(*args)` in the worker pool and await it. With `deadline_of`, refuse to
        start it once that call's deadline has passed (it may have waited in the queue)."""

        def run() -> T:
            remaining = None if deadline_of is None else deadline_of.time_remaining()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded("the call's deadline passed before the hub could act")
            return fn(*args)

        remaining = None if deadline_of is None else deadline_of.time_remaining()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded("the call's deadline passed before the hub could act")
        return await asyncio.get_running_loop().run_in_executor(self._workers, run)

    def _tenant(self, context: CallContext) -> Tenant:
        token = bearer(context)
        if token is None:
            raise PermissionDenied("no tenant token: send 'authorization: Bearer <token>'")
        return _as_named(context, self.tenants.authenticate(token))

    async def _stream_tenant(self, context: CallContext) -> Tenant:
        """`_tenant` for a stream: from the cache on the loop when it can, so thousands of
        streams opening at once do not queue behind unary calls for a worker."""
        token = bearer(context)
        cached = None if token is None else self.tenants.cached(token)
        if cached is not None:
            return _as_named(context, cached)
        return await self._blocking(self._tenant, context)

    def _knows_caller(self, context: CallContext) -> bool:
        """Whether `_tenant` can answer from memory (no etcd read): then it may be asked
        on the event loop. False for a token memory cannot settle either way."""
        token = bearer(context)
        try:
            return token is not None and self.tenants.cached(token) is not None
        except PermissionDenied:
            return True  # refused from memory: `_tenant` refuses it the same way, no I/O

    @staticmethod
    def _timeout(context: CallContext) -> float:
        remaining = context.time_remaining()
        if remaining is None:
            return MAX_CALL_SECONDS
        if remaining <= 0:
            raise DeadlineExceeded("the call's deadline passed before the hub could act")
        return min(remaining, MAX_CALL_SECONDS)

    def _versions(self, tenant: Tenant) -> VersionRegistry:
        """The tenant's registry, every write of which is fenced on its record
        (`TenantStore.fence`)."""
        retain = min(self._default_retain, tenant.quotas.max_retained_versions)
        return VersionRegistry(
            self._etcd_for(tenant), self.keys, retain=retain, collector=self._collector,
            usage_cache=self.usage_cache,
        )  # fmt: skip

    def _etcd_for(self, tenant: Tenant) -> Etcd:
        """The etcd connection for writes made on `tenant`'s behalf: each compares that the
        tenant's record is the one it authenticated against (deleted: `PermissionDenied`)."""
        fence = self.tenants.fence(tenant)
        return self.etcd if fence is None else self.etcd.fenced(fence)

    def _holders(self, tenant: Tenant) -> HolderRegistry:
        return HolderRegistry(self._versions(tenant))

    def _own_session(self, tenant: Tenant, session_id: int, timeout: float) -> None:
        """Refuse to attach records to a lease that is not one of this tenant's live sessions.

        A session that is not this tenant's is answered exactly as a missing one:
        `SessionExpired` (a `LeaseLost`), with the same message, after the same one etcd
        read. Telling "another tenant's live lease" apart (the old `PermissionDenied`) let a
        tenant find other tenants' live session ids by scanning; and to the caller's own SDK
        both mean the same thing: that id is no session of its own, open a new one.
        """
        kv, _ = self.etcd.get(self.keys.session(tenant.name, session_id), timeout=timeout)
        if kv is None:
            raise SessionExpired(
                f"session {session_id:x} has expired or was revoked: open a new one"
            )


def named_tenant(context: CallContext) -> str | None:
    """The tenant the caller says it is (`tensorhub-tenant` metadata), if it says."""
    for key, value in context.invocation_metadata():
        if key == TENANT_METADATA_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


def _as_named(context: CallContext, tenant: Tenant) -> Tenant:
    """`tenant` (the token's), unless the caller named another one: then `PermissionDenied`
    naming both. A client configured as team-b but holding team-a's token must not be
    served as team-a (it would see team-a's models, and its holder server would check
    tokens against team-b). A caller that names no tenant (older SDKs, the CLI's admin
    calls) is served as its token's tenant."""
    named = named_tenant(context)
    if named is not None and named != tenant.name:
        shown = named if len(named) <= 80 else named[:77] + "..."
        raise PermissionDenied(
            f"the client names tenant {shown!r} but its token is tenant {tenant.name!r}'s"
        )
    return tenant


def bearer(context: CallContext) -> str | None:
    for key, value in context.invocation_metadata():
        if key == "authorization":
            text = value if isinstance(value, str) else value.decode()
            if text.startswith("Bearer "):
                return text[len("Bearer ") :].strip()
    return None


def same(a: str, b: str) -> bool:
    return hmac.compare_digest(a, b)
