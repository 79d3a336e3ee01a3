"""Retries: one policy type, and one table of what is worth another try.

Every retry loop of TensorHub is a `RetryPolicy` (tenacity's own stop and wait objects
underneath, the model being kazoo's `KazooRetry`: tries, backoff, jitter, deadline, and a
sleep and a clock that tests replace): `Etcd.call` and `Etcd.call_member` (each etcd
request), every long-lived stream (`consistency.reopen.keep_open`: the watches `WatchMux`
and `HubWatch`, and the SDK's and the hub's lease keepalives, `ros.client.lease` and
`consistency.keepalive`), the SDK's fresh reads (`ros.client.reads.FreshReads.fresh`: an
answer older than the revision floor), its other unary calls (`ros.client.rpc.UNARY_POLICY`),
`OpenSession` at connect (`ros.client.session.OPEN_POLICY`), the session's recovery after a
loss (`OpenSession` and re-registration, `ros.client.session.RECOVERY_POLICY`: every
failure, until closed), the resend of a `Publish` read back as absent
(`ros.client.publishing.PUBLISH_RESEND`), and the compare-and-set loops of
`consistency.holders`, `consistency.publishing`, `consistency.deletion`,
`consistency.versions`, `ros.hub.rpc_sessions` and `ros.hub.holder_index`
(`RetryPolicy.compare_and_set`). gRPC's own `retryPolicy` is not used: one layer per call
(docs/design-notes.md, "One retry layer"). Every named policy is defined once, at the end of
this module; a loop with a predicate of its own (`retry_on` over a module's private error)
keeps its policy next to that predicate.

**What is retried** (`is_retryable`): a failure after which another try, on another etcd
member or hub replica or a moment later, may succeed, and repeats nothing harmful.

- gRPC `UNAVAILABLE` (`RETRYABLE_CODES`): the member or replica could not answer (refused,
  "no leader", stopping).
- gRPC `DEADLINE_EXCEEDED`, and etcd's `UNKNOWN` "context deadline exceeded" (`is_deadline`):
  one try's deadline ran out; the policy's deadline bounds them all.
- `Unavailable` (`RETRYABLE_ERRORS`): no member or replica answered (a read's
  `WriteUnconfirmed` too; a write's becomes `OutcomeUnknown` before any loop sees it).
- `DeadlineExceeded`: an inner call's deadline ran out; the loop's own deadline decides.
- `Overloaded`: a replica at a stream or call limit; it waits on the slower `overloaded_*`
  schedule, so the load on the replica falls while it stays overloaded.
- `StaleRead`: a lagging replica answered; a later answer (or another replica's) is fresh.
- On a read stream only (`resumable=True`, `RESUMABLE_CODES`): gRPC `UNKNOWN`, `INTERNAL`,
  `CANCELLED`, how a stream breaks when its server dies or stops ("Stream removed",
  RST_STREAM, etcd's "watch canceled"). A watch resumes from the revision after its last
  event, so nothing is lost or repeated; on a unary call the same codes are not retried.

Everything else propagates at once, with the last try's error: refusals (`InvalidArgument`,
`PermissionDenied`, `QuotaExceeded`, `StaleVersion`, `VersionNotFound`, `StorageFull`), and
`OutcomeUnknown` and gRPC `UNKNOWN` on a unary call (a write that may have been applied: read
back, never repeat blindly). A loop with conditions of its own beyond the table (the fetch's
rounds after a refresh: `VersionUnavailable`, `IntegrityError`; a holder that is not
listening yet: `ConnectionRefusedError`) passes `retry_on`; it still gets the same tries,
backoff, jitter, deadline and sleep.

**Lost races** (`compare_and_set`): a transaction whose compare failed because another writer
changed what the attempt read is re-read and tried again: the attempt raises `LostRace`, the
policy backs off and tries again until its tries or deadline run out, and then the loop's own
named error is raised. Errors of the transaction itself propagate at once: `Etcd.call` has
already retried them until the deadline, and a write's may have been applied.

**Backoff** is exponential with full jitter (tenacity's `wait_exponential`, drawn uniformly):
the wait after try n (1 for the first) is a uniform draw in [0, min(maximum, initial *
2**(n - 1))], so clients that failed together do not come back together. It never sleeps past
the deadline (the last try gets what is left), and none follows a try that ended within
`_SLACK` of it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import grpc
import tenacity
from tenacity.stop import stop_base
from tenacity.wait import wait_base

from tensorhub.errors import DeadlineExceeded, Overloaded, StaleRead, Unavailable

T = TypeVar("T")

# gRPC codes that mean "this member could not answer now; another member (or a later try)
# may". UNAVAILABLE covers connection refused, "leader changed" and "no leader";
# DEADLINE_EXCEEDED is a per-attempt timeout, retried while the overall deadline allows.
RETRYABLE_CODES: tuple[grpc.StatusCode, ...] = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)
# How a read stream breaks besides those; retried only where the read resumes (a watch).
RESUMABLE_CODES: tuple[grpc.StatusCode, ...] = (
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.CANCELLED,
)
# TensorHubErrors that mean the same (see the table in the module docstring).
RETRYABLE_ERRORS: tuple[type[Exception], ...] = (
    Unavailable,
    DeadlineExceeded,
    Overloaded,
    StaleRead,
)

_SLACK = 0.01  # seconds: no try starts this close to the deadline


class LostRace(Exception):
    """An attempt's compare failed: another writer changed what it read. Raised inside
    `RetryPolicy.compare_and_set` only; the loop's own error is raised when it gives up."""


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


def is_retryable(exc: BaseException, *, resumable: bool = False) -> bool:
    """Whether `exc` is in the table of the module docstring; `resumable`: the failed call is
    a read stream that resumes where it stopped, so a broken stream is retried too."""
    if isinstance(exc, grpc.RpcError):
        code = exc.code()
        if code in RETRYABLE_CODES or is_deadline(exc):
            return True
        return resumable and code in RESUMABLE_CODES
    return isinstance(exc, RETRYABLE_ERRORS)


def full_jitter(high: float) -> float:
    """A uniform draw in [0, high]: the jitter of every backoff."""
    return random.uniform(0.0, high)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to try again, and how to wait in between.

    `tries` (None: until the deadline, or forever without one) counts the first try.
    `initial` and `maximum` bound the full-jitter backoff (module docstring); an `Overloaded`
    refusal waits on `overloaded_initial` and `overloaded_maximum` instead (a replica at its
    limit should see its load fall, not a crowd back in lock-step). `retry_on` replaces the
    table of retryable conditions (for a loop with its own, named). `sleep` (None: the
    loop's own wait, `time.sleep` unless it interrupts sooner on close), `clock` and `jitter`
    are what tests replace.
    """

    initial: float = 0.05
    maximum: float = 1.0
    tries: int | None = None
    overloaded_initial: float = 0.2
    overloaded_maximum: float = 5.0
    retry_on: Callable[[BaseException], bool] | None = None
    sleep: Callable[[float], object] | None = None
    clock: Callable[[], float] = time.monotonic
    jitter: Callable[[float], float] = field(default=full_jitter)

    def deadline(self, timeout: float) -> float:
        """The deadline `timeout` seconds from now, on the policy's clock."""
        return self.clock() + timeout

    def retryable(self, exc: BaseException, *, resumable: bool = False) -> bool:
        """Whether this policy tries again after `exc` (`retry_on`, else the table)."""
        if self.retry_on is not None:
            return self.retry_on(exc)
        return is_retryable(exc, resumable=resumable)

    def delay(self, attempt: int, exc: BaseException | None = None) -> float:
        """The wait after try `attempt` (1 for the first) failed with `exc`, not clamped:
        what the loop's tenacity wait answers, for loops that wait on their own (a stream's
        reopening, `consistency.reopen`; the read token's renewal)."""
        state = tenacity.RetryCallState(tenacity.Retrying(), None, (), {})
        state.attempt_number = attempt
        return self._backoff(exc)(state)

    def _backoff(self, exc: BaseException | None) -> wait_base:
        """The schedule after `exc`: tenacity's exponential wait (`initial` doubling up to
        `maximum`, or the `overloaded_*` pair after `Overloaded`), drawn through `jitter`."""
        if isinstance(exc, Overloaded):
            schedule = tenacity.wait_exponential(
                multiplier=self.overloaded_initial, max=self.overloaded_maximum
            )
        else:
            schedule = tenacity.wait_exponential(multiplier=self.initial, max=self.maximum)
        return _Jittered(schedule, self.jitter)

    def retrying(
        self,
        deadline: float | None,
        *,
        resumable: bool = False,
        stop: Callable[[], bool] | None = None,
        sleep: Callable[[float], object] | None = None,
        before_sleep: Callable[[BaseException, float], None] | None = None,
    ) -> tenacity.Retrying:
        """A tenacity loop over the policy: retry what `retryable` says until `tries`, the
        `deadline` (on `clock`; None: none) or `stop()` ends it, then raise the last try's
        error. `sleep` is the loop's own wait when the policy sets none (a watch's
        close-interruptible wait); `before_sleep(error, seconds)` sees every backoff."""
        return self._retrying(
            tenacity.retry_if_exception(lambda e: self.retryable(e, resumable=resumable)),
            deadline,
            stop,
            sleep,
            before_sleep,
        )

    def call(self, fn: Callable[[], T], deadline: float | None) -> T:
        """`fn()`, tried again as `retrying(deadline)` says; its value, or the last error."""
        result: T = self.retrying(deadline)(fn)
        return result

    def compare_and_set(
        self,
        attempt: Callable[[], T],
        deadline: float | None,
        exhausted: Callable[[], BaseException],
    ) -> T:
        """`attempt()` until it returns; a `LostRace` it raises is tried again after a
        backoff, and when the tries or the deadline run out `exhausted()` is raised (from the
        last `LostRace`). Any other error of `attempt` propagates at once (module docstring)."""

        if deadline is not None and self.clock() >= deadline - _SLACK:
            raise exhausted()  # no time for even one try

        def give_up(state: tenacity.RetryCallState) -> Any:
            last = state.outcome.exception() if state.outcome is not None else None
            raise exhausted() from last

        retrying = self._retrying(
            tenacity.retry_if_exception_type(LostRace), deadline, None, None, None, give_up
        )
        result: T = retrying(attempt)
        return result

    # -- tenacity plumbing -------------------------------------------------------------------

    def _retrying(
        self,
        retry: tenacity.retry_base,
        deadline: float | None,
        stop: Callable[[], bool] | None,
        sleep: Callable[[float], object] | None,
        before_sleep: Callable[[BaseException, float], None] | None,
        give_up: Callable[[tenacity.RetryCallState], Any] | None = None,
    ) -> tenacity.Retrying:
        """The policy as tenacity's own objects: `stop_after_attempt` any `_StopAt` the
        deadline any `_StopWhen` asked; the wait chosen by the failure (`_ByFailure`), never
        past the deadline (`_UntilDeadline`)."""
        stops: list[stop_base] = []
        if self.tries is not None:
            stops.append(tenacity.stop_after_attempt(self.tries))
        if deadline is not None:
            stops.append(_StopAt(deadline, self.clock))
        if stop is not None:
            stops.append(_StopWhen(stop))
        wait: wait_base = _ByFailure(self._backoff)
        if deadline is not None:
            wait = _UntilDeadline(wait, deadline, self.clock)

        def announce(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            if before_sleep is not None and exc is not None:
                before_sleep(exc, state.upcoming_sleep)

        do_sleep = self.sleep or sleep or time.sleep

        def nap(seconds: float) -> None:
            do_sleep(seconds)

        return tenacity.Retrying(
            retry=retry,
            wait=wait,
            stop=tenacity.stop_any(*stops) if stops else tenacity.stop_never,
            sleep=nap,
            before_sleep=announce,
            retry_error_callback=give_up,
            reraise=True,
        )


class _Jittered(wait_base):
    """A tenacity wait drawn through `jitter` (full jitter by default: uniform in
    [0, the wait]; tests pass the identity, for exact schedules)."""

    def __init__(self, wait: wait_base, jitter: Callable[[float], float]) -> None:
        self._wait, self._jitter = wait, jitter

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        return self._jitter(self._wait(retry_state))


class _ByFailure(wait_base):
    """The wait that the failed try's error calls for (`RetryPolicy._backoff`)."""

    def __init__(self, choose: Callable[[BaseException | None], wait_base]) -> None:
        self._choose = choose

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        outcome = retry_state.outcome
        exc = outcome.exception() if outcome is not None else None
        return self._choose(exc)(retry_state)


class _UntilDeadline(wait_base):
    """`wait`, cut to what is left before `deadline` (the last try gets what is left)."""

    def __init__(self, wait: wait_base, deadline: float, clock: Callable[[], float]) -> None:
        self._wait, self._deadline, self._clock = wait, deadline, clock

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        return max(0.0, min(self._wait(retry_state), self._deadline - self._clock()))


class _StopAt(stop_base):
    """Stop within `_SLACK` of `deadline` on the policy's `clock` (tenacity's own
    `stop_before_delay` counts from the loop's start on its own clock, which tests cannot
    replace)."""

    def __init__(self, deadline: float, clock: Callable[[], float]) -> None:
        self._deadline, self._clock = deadline, clock

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self._clock() >= self._deadline - _SLACK


class _StopWhen(stop_base):
    """Stop once `stopped()` says so (a watch or a session being closed)."""

    def __init__(self, stopped: Callable[[], bool]) -> None:
        self._stopped = stopped

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self._stopped()


# -- the named policies: every module-level policy of the etcd layer, the hub and the SDK --

DEFAULT_POLICY = RetryPolicy()
"""An etcd client's and the SDK's default (`Etcd.policy`, `ros.connect(retry=)`): 50 ms
doubling to 1 s, full jitter, until the call's deadline."""

CAS_POLICY = RetryPolicy(initial=0.005, maximum=0.2)
"""Lost compare-and-set races: the other writer is done by now, so the first retry comes
soon; the jitter spreads a crowd of writers of one key."""

USAGE_RACES = replace(CAS_POLICY, tries=8)
"""A tenant's usage key changed under a write that also charges it (a version collected,
a model deleted): publishes of the same tenant move it meanwhile; 8 tries."""

LAYOUT_RACES = replace(CAS_POLICY, tries=64)
"""A registration that records a layout block set (`consistency.layouts`) lost the compare
on its version's tally or its tenant's usage key: every worker of a layout that finishes at
once creates a block set of the same version, each round commits at least one of them, so
the tries are many (64 rounds), and the call's deadline bounds them in time."""

COMPACTION_RACES = replace(CAS_POLICY, tries=3)
"""Loading a model's holder index (`ros.hub.holder_index`): the compactor may pass the
revision it read meanwhile; 3 tries."""

UNARY_POLICY = RetryPolicy(
    initial=0.05, maximum=1.0, tries=5, retry_on=lambda e: isinstance(e, Unavailable)
)
"""The one retry of a plain hub call (`ros.client.rpc`): an idempotent method refused as
`Unavailable` (the replica died, the channel moves to the next) is sent again, up to 5 tries,
50 ms doubling to 1 s (full jitter), all within the call's own deadline. Calls that run
inside a loop of their own (fresh reads, session recovery, publish) use `HubRpc.once`
instead: never two layers."""

OPEN_POLICY = RetryPolicy(tries=9, retry_on=lambda e: isinstance(e, (Overloaded, Unavailable)))
"""OpenSession at connect (`ros.client.session`): a replica at its limit (`Overloaded`, on
the policy's slower schedule) or unreachable (`Unavailable`) is asked again, 9 tries within
the client's timeout."""

RECOVERY_POLICY = RetryPolicy(initial=0.1, maximum=2.0, retry_on=lambda e: isinstance(e, Exception))
"""The session's recovery after a loss (`ros.client.session`): every failure is worth
another try (the hub may come back, a quota may free up, a replica may stop lagging); the
backoff grows to 2 s and stays there, until the client closes."""

RENEWAL_WAIT = 1.0
"""Seconds between a read token's renewal attempts after one failed (`ros.client.read_token`)."""

RENEWAL_POLICY = RetryPolicy(initial=RENEWAL_WAIT, maximum=RENEWAL_WAIT, jitter=lambda high: high)
"""The wait after a failed read-token renewal: `RENEWAL_WAIT`, every time (each is one
Resolve)."""
