"""How the SDK recognises the hub's `Overloaded` refusal, which it waits out on the slower
schedule of its `RetryPolicy` (`overloaded_*`: full jitter, 0.2 s doubling to 5 s).

A replica at its stream limit refuses new KeepAlive and Watch streams at once. If every
refused client retried on a short fixed loop, a replica coming back, or one that lost a
neighbour, would be hit by the whole crowd in lock-step; exponential backoff with full
jitter spreads the retries out, so the load on the replica falls while it stays overloaded.
"""

from __future__ import annotations

import grpc

from ros.errors import from_rpc_error
from tensorhub.errors import Overloaded


def is_overloaded(exc: grpc.RpcError) -> bool:
    """Whether a failed call is the hub's `Overloaded` refusal (not a quota, not a crash)."""
    return (
        isinstance(exc, grpc.Call)
        and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        and isinstance(from_rpc_error(exc), Overloaded)
    )
