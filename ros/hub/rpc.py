"""How a hub handler is run: the wrappers that give every handler its deadline, its
authenticated caller, its error mapping and its metrics.

The hub serves on `grpc.aio` (see `ros.hub.server`): streams are coroutines, so they cost
memory, not threads. Unary handler bodies stay synchronous (they call the blocking etcd
client); `unary` runs each in ONE bounded worker pool, handing it a `CallContext` (the
call's metadata, deadline and caller, read once on the event loop) instead of the aio
context, which must not be touched from another thread. A call whose deadline has passed by
the time it would run is refused, not run.

Every handler runs under a deadline (the caller's, capped at `MAX_CALL_SECONDS`), maps errors
through `ros.errors` (the class name travels in the `tensorhub-error` trailing metadata; an
unexpected exception is logged and answered INTERNAL), and answers with the etcd revision it
read or wrote at. The hub keeps no state of its own beyond caches: any replica can serve any
call.

The wrappers apply to methods of any object with a `hub` that runs calls (`Runs`; the
replica's `ros.hub.state.HubState` is one): the handler groups and the servicer. Each group
declares its `hub` as a protocol that adds to `Runs` only what its handlers use
(`SessionHub`, `PublishHub`, `VersionHub`, `ListingHub`, `HolderHub`, `ModelHub`,
`TenantHub`, `LayoutHub`; docs/design-notes.md, "What each handler group receives").
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any, Protocol, TypeVar

from consistency import HolderRegistry, VersionRegistry
from ros.hub.call import AioContext, CallContext, abort, internal
from ros.hub.tenants import Tenant
from ros.metrics import HUB_LATENCY, HUB_REQUESTS
from tensorhub.errors import StorageFull, TensorHubError

T = TypeVar("T")


class Runs(Protocol):
    """What the wrappers need of a replica: its worker pool and its NOSPACE signal."""

    on_storage_full: Callable[[], None]

    async def blocking(
        self, fn: Callable[..., T], *args: Any, deadline_of: CallContext | None = None
    ) -> T: ...


class Registries(Runs, Protocol):
    """A replica that runs calls, times them and gives each tenant's registries: what the
    publish, version, listing and holder handlers (`PublishHub`, `VersionHub`, `ListingHub`,
    `HolderHub`) build on."""

    def timeout(self, context: CallContext) -> float: ...

    def versions(self, tenant: Tenant) -> VersionRegistry: ...

    def holders(self, tenant: Tenant) -> HolderRegistry: ...


class Served(Protocol):
    """What the wrappers need of a handler's owner: a replica that runs its calls."""

    @property
    def hub(self) -> Runs: ...


S = TypeVar("S", bound=Served)
Req = TypeVar("Req")
Resp = TypeVar("Resp")


def unary(
    fn: Callable[[S, Req, CallContext], Resp],
) -> Callable[[S, Req, AioContext], Coroutine[Any, Any, Resp]]:
    """Make a synchronous handler body an aio handler: run it in the replica's bounded
    worker pool with an authenticated `CallContext`; timing, status metrics, error mapping."""

    async def body(self: S, request: Req, call: CallContext) -> Resp:
        return await self.hub.blocking(fn, self, request, call, deadline_of=call)

    return functools.wraps(fn)(_answered(fn.__name__, body))


def unary_async(
    fn: Callable[[S, Req, CallContext], Coroutine[Any, Any, Resp]],
) -> Callable[[S, Req, AioContext], Coroutine[Any, Any, Resp]]:
    """`unary` for a handler body that is a coroutine: it runs on the event loop and hands
    its blocking parts to the worker pool itself (`HubState.blocking`), so that while it
    waits (for a group commit: `ros.hub.group_commit`) it holds no worker."""
    return functools.wraps(fn)(_answered(fn.__name__, fn))


def _answered(
    name: str, body: Callable[[S, Req, CallContext], Coroutine[Any, Any, Resp]]
) -> Callable[[S, Req, AioContext], Coroutine[Any, Any, Resp]]:
    """The aio handler around `body`, with the caller the guard authenticated: timing,
    status metrics, error mapping."""

    async def wrapper(self: S, request: Req, context: AioContext) -> Resp:
        start = time.monotonic()
        error: TensorHubError
        try:
            response = await body(self, request, CallContext.of(context))
        except StorageFull as exc:  # etcd's NOSPACE: tell health now, not at the next check
            self.hub.on_storage_full()
            error = exc
        except TensorHubError as exc:
            error = exc
        except Exception as exc:  # a bug: answered INTERNAL, not UNKNOWN
            error = internal(name, exc)
        else:
            HUB_REQUESTS.labels(name, "OK").inc()
            HUB_LATENCY.labels(name).observe(time.monotonic() - start)
            return response
        await abort(context, name, error)
        raise error  # not reached: abort raises

    return wrapper


def streaming(
    fn: Callable[[S, Req, AioContext], AsyncGenerator[Resp, None]],
) -> Callable[[S, Req, AioContext], AsyncGenerator[Resp, None]]:
    """Wrap a streaming handler (an async generator) with the same error mapping. The
    handler is closed as soon as its stream ends (cancelled, or the client went away), so
    its `finally` blocks give back stream slots at once, not when it is garbage-collected.
    The handler reads its caller, which the guard authenticated, from `CallContext.of(context)`."""

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
            error = internal(fn.__name__, exc)
        finally:
            await stream.aclose()
        await abort(context, fn.__name__, error)

    return wrapper
