"""The hub's call guard: refuse callers without a valid token, and silent callers, at once.

A hostile client needs no token to open gRPC streams, and a silent call (one that never sends
its request message) would hold a server call for as long as the client liked.
`CallGuard` is a `grpc.aio` server interceptor that runs at call start, before any request
message is read and before any handler, worker or stream slot is involved:

- **Authentication first.** A TensorHub method (every one: tenant calls carry the tenant
  token, admin calls the admin token) without `authorization: Bearer <token>`, with an
  oversized token, or with a token the hub does not know, is refused at once with
  `PermissionDenied` (the class name in the `tensorhub-error` trailing metadata, like every
  hub error). A known token is answered from the tenant cache on the event loop; an unknown
  one costs one etcd read in the worker pool. This is the call's one authentication: the
  caller found (a tenant, or the admin) is handed to the handler (`ros.hub.call`). When etcd
  could not tell (unreachable), the guard tries once more in the call's own task, under the
  call's deadline, once the first request message is in, and answers the error if that
  fails too; no handler authenticates.
- **A first-message deadline.** Every method (health checks and reflection included) must
  receive its first request message within `first_message_seconds` (default
  `DEFAULT_FIRST_MESSAGE_SECONDS`, `tensorhub serve --first-message-timeout`); otherwise the
  call ends with `DeadlineExceeded` naming the limit. A KeepAlive stream's first renewal
  arrives before the stream takes its slot. Later messages of a KeepAlive stream are not
  timed: an idle session renews every few seconds and the slot is bounded per tenant.
- **A bound on calls awaiting their first message.** Silent calls hold no slot and no
  worker, but each holds one of gRPC's concurrent calls until its deadline: at most
  `max_pending` of one token (one tenant: its stream limit) and `MAX_PENDING_OPEN` without
  one (health checks, reflection) wait at once; past it a call is refused at once with
  `Overloaded`, so one tenant's silent calls cannot take the replica's call budget.

Refused calls are counted in `tensorhub_hub_calls_refused_total{reason}`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from ros.hub.call import GUARDED_CALLER, CallContext, Caller, abort, bearer
from ros.metrics import HUB_CALLS_REFUSED
from tensorhub.errors import (
    DeadlineExceeded,
    InvalidArgument,
    Overloaded,
    PermissionDenied,
    TensorHubError,
)

log = logging.getLogger(__name__)

DEFAULT_FIRST_MESSAGE_SECONDS = 10.0
DEFAULT_MAX_PENDING = 8192  # calls of one token awaiting their first message at once
MAX_PENDING_OPEN = 1024  # the same for calls without a token (health checks, reflection)
MAX_TOKEN_CHARS = 512  # far above any token the hub issues; a longer one is not read

Metadata = Sequence[tuple[str, str | bytes]]
# The caller of a call with a (well-formed) bearer token: the admin or a known tenant;
# raises `PermissionDenied` (saying why) if it is neither.
TokenCheck = Callable[[CallContext], Awaitable[Caller]]


class CallGuard(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Authenticate TensorHub calls at call start; bound the wait for every first message.

    `guarded` is the method prefix that needs a token (`/tensorhub.v1.TensorHub/`),
    `known(call)` answers the caller a bearer token belongs to and raises
    `PermissionDenied` if it is nobody's; the caller is handed to the handler.
    `max_pending`: calls of one token awaiting their first message at once. Used on the
    server's event loop only (its counts need no lock).
    """

    def __init__(
        self,
        guarded: str,
        known: TokenCheck,
        first_message_seconds: float = DEFAULT_FIRST_MESSAGE_SECONDS,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        if first_message_seconds <= 0:
            raise InvalidArgument(
                f"first_message_seconds must be positive, got {first_message_seconds}"
            )
        self._guarded = guarded
        self._known = known
        self._first = first_message_seconds
        self._max_pending = max_pending
        self._pending: dict[str, int] = {}  # by token ("" for calls without one)

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler  # an unknown method: gRPC answers UNIMPLEMENTED
        method: str = handler_call_details.method
        name = method.rsplit("/", 1)[-1]
        key, limit = "", MAX_PENDING_OPEN
        caller: Caller | None = None
        if method.startswith(self._guarded):
            metadata: Metadata = handler_call_details.invocation_metadata or ()
            call = CallContext(metadata, None)
            found = await self._caller(call)
            if isinstance(found, TensorHubError):
                refused: grpc.RpcMethodHandler[Any, Any] = _refuse(handler, name, found)
                return refused
            caller = found
            key, limit = bearer(call) or "", self._max_pending
        again = self._known if method.startswith(self._guarded) and caller is None else None
        guarded: grpc.RpcMethodHandler[Any, Any] = _first_message_within(
            handler, self._first, _Pending(self._pending, key, limit), caller, _Again(again, name)
        )
        return guarded

    async def _caller(self, call: CallContext) -> Caller | PermissionDenied | Overloaded | None:
        """The call's caller; or why its token is refused; or None if it could not be told
        (etcd unreachable: `_Again` tries again in the call's task and answers the error)."""
        token = bearer(call)
        if not token:
            HUB_CALLS_REFUSED.labels("no_token").inc()
            return PermissionDenied("no token: send 'authorization: Bearer <token>'")
        if len(token) > MAX_TOKEN_CHARS or not token.isprintable():
            HUB_CALLS_REFUSED.labels("bad_token").inc()
            return PermissionDenied("malformed token")
        try:
            return await self._known(call)
        except PermissionDenied as exc:
            HUB_CALLS_REFUSED.labels("bad_token").inc()
            return exc
        except Overloaded as exc:  # too many unknown tokens being checked at once
            HUB_CALLS_REFUSED.labels("unknown_tokens").inc()
            return exc
        except TensorHubError as exc:  # etcd unreachable: the handler answers that
            log.info("could not check a token at call start: %s", exc)
        return None


def _refuse(handler: grpc.RpcMethodHandler[Any, Any], method: str, error: TensorHubError) -> Any:
    """A handler that answers `error` at once, without reading a request message (a
    request-streaming handler is called before any message arrives)."""

    async def refuse(_requests: object, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await abort(context, method, error)

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(
            refuse, handler.request_deserializer, handler.response_serializer
        )
    return grpc.stream_unary_rpc_method_handler(
        refuse, handler.request_deserializer, handler.response_serializer
    )


async def _first(
    requests: AsyncIterator[Any], seconds: float, context: grpc.aio.ServicerContext[Any, Any]
) -> tuple[bool, Any]:
    """(True, the first request message), or (False, None) if the client half-closed
    without one; the call is aborted with `DeadlineExceeded` if none came in `seconds`."""
    try:
        return True, await asyncio.wait_for(anext(requests), seconds)
    except StopAsyncIteration:
        return False, None
    except TimeoutError:
        HUB_CALLS_REFUSED.labels("first_message").inc()
        error = DeadlineExceeded(
            f"no request message within {seconds:g}s of the call's start "
            "(--first-message-timeout): call ended"
        )
        await abort(context, "first_message", error)
        raise  # not reached: abort raises


class _Again:
    """The second try at a guarded call's caller, when the first could not tell (`known` is
    None when there is nothing to try again: the caller is known, or the method is not
    guarded). `method` names the call in the error answered."""

    def __init__(self, known: TokenCheck | None, method: str) -> None:
        self._known = known
        self._method = method

    async def caller(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Authenticate the call (its deadline: the call's) and hand the caller to its
        handler through `GUARDED_CALLER`; answer the error if that fails too."""
        if self._known is None:
            return
        try:
            GUARDED_CALLER.set(await self._known(CallContext.of(context)))
        except TensorHubError as exc:
            await abort(context, self._method, exc)


class _Pending:
    """One call's place among those of its token (`key`) awaiting a first message."""

    def __init__(self, counts: dict[str, int], key: str, limit: int) -> None:
        self._counts = counts
        self._key = key
        self._limit = limit

    def enter(self) -> Overloaded | None:
        """Count the call in, or the `Overloaded` to refuse it with (then not counted)."""
        waiting = self._counts.get(self._key, 0)
        if waiting >= self._limit:
            HUB_CALLS_REFUSED.labels("pending").inc()
            whose = "of this tenant " if self._key else "without a token "
            return Overloaded(
                f"{waiting} calls {whose}await their first request message on this hub "
                f"replica (limit {self._limit}): send it, or retry later"
            )
        self._counts[self._key] = waiting + 1
        return None

    def leave(self) -> None:
        left = self._counts[self._key] - 1
        if left:
            self._counts[self._key] = left
        else:
            del self._counts[self._key]


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


def _first_message_within(
    handler: grpc.RpcMethodHandler[Any, Any],
    seconds: float,
    pending: _Pending,
    caller: Caller | None,
    again: _Again,
) -> Any:
    """`handler` as a request-streaming handler that waits at most `seconds` for the first
    request message before it calls the original (same serializers, same response style:
    a coroutine that writes, or an async generator), counted in `pending` while it waits.
    The original runs with `caller` in `GUARDED_CALLER` (in the call's own task), or the one
    `again` finds once the first message is in."""
    kinds: list[Any] = [
        handler.unary_unary,
        handler.unary_stream,
        handler.stream_unary,
        handler.stream_stream,
    ]
    inner: Callable[..., Any] = kinds[2 * handler.request_streaming + handler.response_streaming]
    streaming_in = handler.request_streaming

    async def arguments(requests: AsyncIterator[Any], context: Any) -> Any:
        GUARDED_CALLER.set(caller)
        refusal = pending.enter()
        if refusal is not None:  # before the receiver exists: nothing is left unawaited
            await abort(context, "first_message", refusal)
        stream = aiter(requests)
        try:
            got, first = await _first(stream, seconds, context)
        finally:
            pending.leave()
        if not streaming_in and not got:
            await abort(context, "first_message", InvalidArgument("no request message"))
        await again.caller(context)
        if streaming_in:
            return _chain(first, stream) if got else stream
        return first

    if handler.response_streaming and inspect.isasyncgenfunction(inner):

        async def generate(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            request = await arguments(requests, context)
            async for response in inner(request, context):
                yield response

        return grpc.stream_stream_rpc_method_handler(
            generate, handler.request_deserializer, handler.response_serializer
        )

    async def call(requests: AsyncIterator[Any], context: Any) -> Any:
        request = await arguments(requests, context)
        result = inner(request, context)
        return await result if inspect.isawaitable(result) else result

    make = (
        grpc.stream_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.stream_unary_rpc_method_handler
    )
    return make(call, handler.request_deserializer, handler.response_serializer)
