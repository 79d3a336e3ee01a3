"""How the SDK waits before reopening a stream the hub refused with `Overloaded`.

A replica at its stream limit refuses new KeepAlive and Watch streams at once. If every
refused client retried on a short fixed loop, a replica coming back, or one that lost a
neighbour, would be hit by the whole crowd in lock-step. Exponential backoff with *full
jitter* (a uniform draw in [0, min(cap, base * 2**attempt)]) spreads the retries out, so the
load on the replica falls as it stays overloaded instead of synchronizing. Both are the
one `consistency.retry.RetryPolicy` (its `overloaded_*` schedule), as every SDK retry is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import grpc

from consistency.retry import RetryPolicy
from ros.errors import from_rpc_error
from tensorhub.errors import Overloaded

OVERLOAD_BASE = 0.2  # seconds: the first retry waits up to this
OVERLOAD_CAP = 5.0  # seconds: no retry waits longer than this
MAX_UNARY_RETRIES = 8  # a unary call refused with Overloaded is tried at most this often more
T = TypeVar("T")
# Overloaded only: other errors of the call are its caller's (gRPC retries UNAVAILABLE itself).
_UNARY_OVERLOAD = RetryPolicy(
    tries=MAX_UNARY_RETRIES + 1,
    overloaded_initial=OVERLOAD_BASE,
    overloaded_maximum=OVERLOAD_CAP,
    retry_on=lambda exc: isinstance(exc, Overloaded),
)


def is_overloaded(exc: grpc.RpcError) -> bool:
    """Whether a failed call is the hub's `Overloaded` refusal (not a quota, not a crash)."""
    return (
        isinstance(exc, grpc.Call)
        and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        and isinstance(from_rpc_error(exc), Overloaded)
    )


def retry_overloaded(call: Callable[[], T], budget: float) -> T:
    """`call()`, tried again with jittered backoff while it raises `Overloaded` (a replica
    at a limit, or gRPC's own concurrent-call limit), for at most `budget` seconds and
    `MAX_UNARY_RETRIES` retries; then the last `Overloaded` is raised. For idempotent
    calls only (opening a session: a refused one opened nothing)."""
    return _UNARY_OVERLOAD.call(call, _UNARY_OVERLOAD.deadline(budget))
