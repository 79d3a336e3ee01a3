"""`consistency.retry.RetryPolicy` on its own: the delays it waits, when it stops, and what it
raises, with an injected clock and sleep (nothing here really sleeps) and an injected jitter
that draws the top of each range, so the schedule is exact."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from consistency.retry import LostRace, RetryPolicy, full_jitter, is_retryable
from tensorhub.errors import (
    DeadlineExceeded,
    InvalidArgument,
    OutcomeUnknown,
    Overloaded,
    PermissionDenied,
    QuotaExceeded,
    StaleRead,
    Unavailable,
)


class FakeClock:
    """Time that moves only when the policy sleeps; records every sleep."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.slept.append(round(seconds, 6))
        self.now += seconds


def policy(clock: FakeClock, **kw: object) -> RetryPolicy:
    return RetryPolicy(clock=clock, sleep=clock.sleep, jitter=lambda high: high, **kw)  # type: ignore[arg-type]


def failing(errors: list[BaseException], value: str = "done") -> Callable[[], str]:
    """A call that raises each of `errors` in turn, then returns `value`."""
    calls = iter(errors)

    def call() -> str:
        for exc in calls:
            raise exc
        return value

    return call


class Status(grpc.RpcError):
    """A gRPC error with a code, as a call raises it."""

    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_backoff_doubles_from_initial_to_maximum_then_returns() -> None:
    clock = FakeClock()
    errors: list[BaseException] = [Unavailable(f"try {i}") for i in range(7)]
    result = policy(clock).call(failing(errors), clock.now + 60)
    assert result == "done"
    assert clock.slept == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def test_full_jitter_draws_below_the_cap() -> None:
    draws = [full_jitter(0.4) for _ in range(200)]
    assert all(0.0 <= d <= 0.4 for d in draws)
    assert len(set(draws)) > 1  # jittered, not fixed


def test_overloaded_waits_on_the_slower_schedule() -> None:
    clock = FakeClock()
    errors: list[BaseException] = [Overloaded("full"), Overloaded("full"), Unavailable("down")]
    policy(clock).call(failing(errors), clock.now + 60)
    assert clock.slept == [0.2, 0.4, 0.2]  # the third wait is a plain one, at try 3


def test_the_deadline_clamps_the_last_wait_and_stops_with_the_last_error() -> None:
    clock = FakeClock()
    errors: list[BaseException] = [Unavailable(f"try {i}") for i in range(100)]
    with pytest.raises(Unavailable, match="try 5"):
        policy(clock).call(failing(errors), clock.now + 1.0)
    # 0.05 + 0.1 + 0.2 + 0.4 = 0.75; the next 0.8 is cut to the 0.25 left; then no more.
    assert clock.slept == [0.05, 0.1, 0.2, 0.4, 0.25]
    assert clock.now == pytest.approx(101.0)


def test_tries_bound_the_attempts() -> None:
    clock = FakeClock()
    errors: list[BaseException] = [StaleRead(f"try {i}") for i in range(10)]
    with pytest.raises(StaleRead, match="try 2"):
        policy(clock, tries=3).call(failing(errors), None)
    assert clock.slept == [0.05, 0.1]


@pytest.mark.parametrize(
    "error",
    [InvalidArgument("bad"), PermissionDenied("no"), QuotaExceeded("full"), OutcomeUnknown("?")],
)
def test_a_non_retryable_error_propagates_at_once(error: Exception) -> None:
    clock = FakeClock()
    errors: list[BaseException] = [Unavailable("first"), error, Unavailable("never reached")]
    with pytest.raises(type(error)) as raised:
        policy(clock).call(failing(errors), clock.now + 60)
    assert raised.value is error  # the last attempt's own error, not a wrapper
    assert clock.slept == [0.05]  # one wait, after the retryable first try


def test_retry_on_replaces_the_table() -> None:
    clock = FakeClock()
    only_refused = policy(clock, retry_on=lambda e: isinstance(e, ConnectionRefusedError))
    assert only_refused.call(failing([ConnectionRefusedError()]), None) == "done"
    with pytest.raises(Unavailable):
        only_refused.call(failing([Unavailable("not in retry_on")]), None)
    assert clock.slept == [0.05]


def test_the_table_of_retryable_conditions() -> None:
    assert is_retryable(Status(grpc.StatusCode.UNAVAILABLE))
    assert is_retryable(Status(grpc.StatusCode.DEADLINE_EXCEEDED))
    assert is_retryable(Status(grpc.StatusCode.UNKNOWN, "context deadline exceeded"))
    for code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED):
        assert not is_retryable(Status(code))  # a unary call: maybe applied, or a bug
        assert is_retryable(Status(code), resumable=True)  # a stream resumes where it stopped
    for code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT):
        assert not is_retryable(Status(code), resumable=True)
    for retryable in (Unavailable(""), DeadlineExceeded(""), Overloaded(""), StaleRead("")):
        assert is_retryable(retryable)
    for refused in (InvalidArgument(""), OutcomeUnknown(""), QuotaExceeded(""), ValueError()):
        assert not is_retryable(refused, resumable=True)


def test_compare_and_set_retries_lost_races_only() -> None:
    clock = FakeClock()
    races: list[BaseException] = [LostRace("moved"), LostRace("moved")]
    assert policy(clock).compare_and_set(failing(races), clock.now + 5, _gave_up) == "done"
    assert clock.slept == [0.05, 0.1]
    # An error of the transaction itself is not a lost race: at once, even a retryable one.
    with pytest.raises(Unavailable, match="etcd down"):
        policy(clock).compare_and_set(failing([Unavailable("etcd down")]), None, _gave_up)
    assert clock.slept == [0.05, 0.1]


def test_compare_and_set_raises_the_loops_error_at_the_deadline() -> None:
    clock = FakeClock()
    races: list[BaseException] = [LostRace(f"race {i}") for i in range(100)]
    with pytest.raises(DeadlineExceeded, match="kept changing") as raised:
        policy(clock).compare_and_set(failing(races), clock.now + 0.5, _gave_up)
    assert isinstance(raised.value.__cause__, LostRace)
    assert sum(clock.slept) == pytest.approx(0.5)
    # No time left at the start: not even one try.
    tried: list[int] = []
    with pytest.raises(DeadlineExceeded):
        policy(clock).compare_and_set(lambda: tried.append(1), clock.now, _gave_up)
    assert not tried


def _gave_up() -> BaseException:
    return DeadlineExceeded("the key kept changing")
