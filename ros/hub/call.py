"""One hub call as its handler sees it: who is calling, its metadata and its deadline; and
how a refusal is answered on the wire.

The caller is authenticated once per call. `ros.hub.guard.CallGuard` does it at call start
(before any request message is read) and hands the result to the handler through
`GUARDED_CALLER`, a context variable of the call's task; `CallContext.of` picks it up, so the
handler body reads `call.tenant()` or `call.admin()` and never authenticates again. A call
the guard did not authenticate has no caller: `tenant()` and `admin()` refuse it.
"""

from __future__ import annotations

import contextvars
import hmac
import logging
import time
from collections.abc import Sequence
from typing import Any, Final

import grpc.aio

from ros.errors import error_metadata, status_of
from ros.hub.tenants import Tenant
from ros.metrics import HUB_INTERNAL_ERRORS, HUB_REQUESTS
from tensorhub.errors import InternalError, PermissionDenied, TensorHubError

log = logging.getLogger(__name__)

MAX_CALL_SECONDS = 30.0  # the most any hub call may take, whatever the caller's deadline
TENANT_METADATA_KEY = "tensorhub-tenant"  # the tenant a client names (checked against its token)
AioContext = grpc.aio.ServicerContext[Any, Any]


class Admin:
    """The hub's admin, as a caller: the holder of the admin token."""

    def __repr__(self) -> str:
        return "ADMIN"


ADMIN: Final = Admin()
Caller = Tenant | Admin

# The caller `CallGuard` authenticated, set in the call's own task before its handler runs.
GUARDED_CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar(
    "tensorhub_guarded_caller", default=None
)


class CallContext:
    """What a handler body may know of its call: the invocation metadata, the deadline and,
    once authenticated, the caller; snapshotted on the event loop (the aio context is not
    thread-safe, and unary bodies run in worker threads).

    It answers `invocation_metadata()` and `time_remaining()` like a gRPC context does.
    """

    def __init__(
        self,
        metadata: Sequence[tuple[str, str | bytes]],
        deadline: float | None,
        caller: Caller | None = None,
    ) -> None:
        self.metadata = tuple(metadata)
        self.deadline = deadline  # time.monotonic() at which the caller gives up; None: never
        self.caller = caller  # None unless the guard authenticated the call

    @classmethod
    def of(cls, context: AioContext) -> CallContext:
        """Snapshot an aio context (call on the event loop, in the call's task), with the
        caller the guard authenticated, if it did."""
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        metadata = [(m[0], m[1]) for m in context.invocation_metadata() or ()]
        return cls(metadata, deadline, GUARDED_CALLER.get())

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self.metadata

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def tenant(self) -> Tenant:
        """The calling tenant; `PermissionDenied` for the admin (tenant calls need a tenant's
        token) or an unauthenticated call."""
        if isinstance(self.caller, Tenant):
            return self.caller
        if self.caller is None:
            raise PermissionDenied("no tenant token: send 'authorization: Bearer <token>'")
        raise PermissionDenied("this call needs a tenant's token, not the admin token")

    def admin(self, what: str) -> None:
        """Return if the admin calls; else `PermissionDenied` saying that `what` needs it."""
        if not isinstance(self.caller, Admin):
            raise PermissionDenied(f"{what} needs the admin token")


def bearer(context: CallContext) -> str | None:
    """The call's bearer token (`authorization: Bearer <token>`), if it sent one."""
    for key, value in context.invocation_metadata():
        if key == "authorization":
            text = value if isinstance(value, str) else value.decode()
            if text.startswith("Bearer "):
                return text[len("Bearer ") :].strip()
    return None


def named_tenant(context: CallContext) -> str | None:
    """The tenant the caller says it is (`tensorhub-tenant` metadata), if it says."""
    for key, value in context.invocation_metadata():
        if key == TENANT_METADATA_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


def as_named(context: CallContext, tenant: Tenant) -> Tenant:
    """`tenant` (the token's), unless the caller named another one: then `PermissionDenied`
    naming both. A client configured as team-b but holding team-a's token must not be
    served as team-a (it would see team-a's models, and its holder server would check
    tokens against team-b). A caller that names no tenant (the CLI's admin calls) is served
    as its token's tenant."""
    named = named_tenant(context)
    if named is not None and named != tenant.name:
        shown = named if len(named) <= 80 else named[:77] + "..."
        raise PermissionDenied(
            f"the client names tenant {shown!r} but its token is tenant {tenant.name!r}'s"
        )
    return tenant


def same(a: str, b: str) -> bool:
    """Constant-time string comparison (for token hashes)."""
    return hmac.compare_digest(a, b)


async def abort(context: AioContext, method: str, error: TensorHubError) -> None:
    """Answer `error` on the wire: its gRPC status, its class name (and fields) in the
    `tensorhub-error` trailing metadata, counted by method and status. Raises (gRPC's
    abort does)."""
    code = status_of(error)
    HUB_REQUESTS.labels(method, code.name).inc()
    log.info("rpc %s failed: %s: %s", method, type(error).__name__, error)
    context.set_trailing_metadata(error_metadata(error))
    await context.abort(code, str(error))


def internal(method: str, exc: Exception) -> InternalError:
    """The `InternalError` a bug (an exception outside the error tree) is answered with;
    logged with its traceback and counted."""
    HUB_INTERNAL_ERRORS.inc()
    log.error("rpc %s failed unexpectedly", method, exc_info=exc)
    return InternalError(f"internal error in {method}: {type(exc).__name__}")
