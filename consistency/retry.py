"""Retry policy for etcd calls: which errors are transient, and how long to keep trying.

One tuple of retryable conditions, one policy object; every retry is bounded by the caller's
deadline (tenacity `stop_before_delay`-style), and the sleep can be swapped out in tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import tenacity

# gRPC codes that mean "this member could not answer now; another member (or a later try)
# may". UNAVAILABLE covers connection refused, "leader changed" and "no leader";
# DEADLINE_EXCEEDED is a per-attempt timeout, retried while the overall deadline allows.
RETRYABLE_CODES: tuple[grpc.StatusCode, ...] = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)


def is_deadline(exc: grpc.RpcError) -> bool:
    """True when the call's deadline ran out, whether the client or the server noticed first.

    etcd 3.4 hands a deadline that expired inside the server back as UNKNOWN "context deadline
    exceeded" (how gRPC renders Go's context error), about as often as the client's own
    DEADLINE_EXCEEDED wins the race; both mean the same thing.
    """
    code = exc.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return True
    return code == grpc.StatusCode.UNKNOWN and "context deadline exceeded" in (exc.details() or "")


def is_retryable(exc: BaseException) -> bool:
    """True for gRPC errors whose code is in `RETRYABLE_CODES`, or that are a deadline."""
    if not isinstance(exc, grpc.RpcError):
        return False
    return exc.code() in RETRYABLE_CODES or is_deadline(exc)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter between `initial` and `maximum` seconds."""

    initial: float = 0.05
    maximum: float = 1.0
    sleep: Callable[[float], None] = time.sleep

    def retrying(self, deadline: float) -> tenacity.Retrying:
        """A tenacity loop that retries transient etcd errors until `deadline` (monotonic)."""
        return tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_retryable),
            wait=tenacity.wait_exponential_jitter(
                multiplier=self.initial, max=self.maximum, jitter=self.initial
            ),
            stop=_stop_at(deadline),
            # A backoff never sleeps past the deadline: the last try gets what is left.
            sleep=lambda seconds: self.sleep(max(0.0, min(seconds, deadline - time.monotonic()))),
            reraise=True,
        )


def _stop_at(deadline: float) -> Callable[[tenacity.RetryCallState], bool]:
    def stop(state: tenacity.RetryCallState) -> bool:
        return time.monotonic() >= deadline - 0.01

    return stop


DEFAULT_POLICY = RetryPolicy()
