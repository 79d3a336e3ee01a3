"""The session's KeepAlive stream is reopened on the client's one `RetryPolicy`: after the
hub goes away, each reopening waits the policy's backoff (doubling), through the policy's
own sleep. Before, the stream was reopened every 0.1 s, whatever the policy said."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

import ros
from consistency.retry import RetryPolicy
from ros.hub.server import HubServer


@pytest.mark.timeout(60)
def test_a_broken_keepalive_stream_is_reopened_with_the_policys_backoff(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    waits: list[float] = []
    enough = threading.Event()

    def sleep(seconds: float) -> None:
        if threading.current_thread().name.startswith("hub-session-"):  # the keepalive's
            waits.append(seconds)
        if len(waits) >= 5:
            enough.set()
        time.sleep(min(seconds, 0.5))

    policy = RetryPolicy(initial=0.05, maximum=1.0, jitter=lambda high: high, sleep=sleep)
    client = connect(session_ttl=20, retry=policy)
    assert client.session.renewals >= 0
    hub_server.stop(grace=0.1)  # every reopening now fails (UNAVAILABLE)
    assert enough.wait(30), f"the stream was reopened through the policy {len(waits)} times"
    assert waits[:5] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8])
    assert not client.session.lost.is_set()  # 20 s of lease: still within it
