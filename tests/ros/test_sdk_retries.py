"""The SDK retries on the client's one `RetryPolicy` (`retry=` of `ros.connect`): a stale
read and a broken watch stream are tried again on its schedule, seen here through an
injected sleep (and clock), with jitter at the top of each range so the schedule is exact."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

import ros
from consistency.retry import RetryPolicy
from ros.hub.server import HubServer
from tensorhub.errors import StaleRead


@pytest.mark.timeout(60)
def test_a_stale_read_is_read_again_on_the_policy_until_its_deadline(
    connect: Callable[..., ros.Hub],
) -> None:
    """`latest` behind the client's revision floor (a lagging replica, simulated by a floor
    far ahead) is read again after each of the policy's waits, and at the deadline the last
    `StaleRead` is raised. The clock is the policy's: nothing really sleeps."""
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(round(seconds, 6))
        now[0] += seconds

    policy = RetryPolicy(clock=lambda: now[0], sleep=sleep, jitter=lambda high: high)
    client = connect(retry=policy)
    assert client.latest("m") == 0  # a fresh answer: no retry
    assert slept == []
    client.floor.observe(10**12)
    with pytest.raises(StaleRead):
        client.latest("m", timeout=1.0)
    assert slept == [0.05, 0.1, 0.2, 0.4, 0.25]  # the last wait cut to what was left


@pytest.mark.timeout(60)
def test_a_hub_watch_backs_off_on_the_clients_policy(
    connect: Callable[..., ros.Hub], hub_server: HubServer
) -> None:
    """With its hub gone, a `HubWatch` waits between reopening attempts as the client's
    policy says (before, a hand-written doubling with `time.sleep`); `close()` ends it."""
    delays: list[float] = []
    backing_off = threading.Event()

    def sleep(seconds: float) -> None:
        # the session's keepalive reopens its stream on the same policy: not the watch's
        if not threading.current_thread().name.startswith("hub-session-"):
            delays.append(round(seconds, 6))
        if len(delays) >= 4:
            backing_off.set()
        time.sleep(0.01)  # not the schedule's time: the watch only has to yield the CPU

    client = connect(retry=RetryPolicy(sleep=sleep, jitter=lambda high: high))
    watch = client.watch("m", since=1)
    try:
        hub_server.stop(grace=0.2)
        assert backing_off.wait(30), f"the watch did not back off: {delays}"
        assert delays[:4] == [0.05, 0.1, 0.2, 0.4]
    finally:
        watch.close()
