"""The sole holder of a version frozen with SIGSTOP while readers wait (issue 25, "also
untested"): a publisher process with a 3 s session holds policy@1 alone.

A frozen process is the gray failure: its sockets stay open and the kernel still accepts
connections on its port, but nothing answers. What must hold:

- readers waiting on it get a named error within their deadline, never a hang; one with a
  long deadline (30 s) is let go once the holder is suspected and its lease has expired
  (about 5 s: measured 4.2 s), not at its deadline;
- once the frozen holder's lease has expired, its record is gone and a fetch is refused
  as `VersionUnavailable` at once, not after its whole deadline;
- after SIGCONT the holder finds its session lost, opens a new one and registers policy@1
  again (`ros.client.session`), and readers fetch the publisher's bytes from it.

(A reader cannot find "another holder" here: only the frozen one has the bytes; the case
with a second holder is the SDK's failover, tested in `tests/transport/test_failover.py`.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import ros
from consistency import HolderRecord
from ros.hub.server import HubServer
from tests.ros.helpers import digest, make_model
from tests.waiting import wait_until

TTL = 3  # the frozen holder's session
READ_DEADLINE = 4.0  # the waiting readers' fetch timeout
LONG_DEADLINE = 30.0  # a reader that would wait long: the lease's expiry must end it first
# The frozen holder is suspected after the data plane's stall window (5 s without a byte);
# its lease is gone by then (TTL 3 s), so the next Resolve finds no holder.
UNAVAILABLE_WITHIN = 5.0 + TTL
SLACK = 5.0  # what a loaded machine may add to a deadline before the call returns


@pytest.fixture
def holder(
    hub_server: HubServer, make_tenant: Callable[[str], str]
) -> Iterator[tuple[subprocess.Popen[str], dict[str, object], str]]:
    """The publisher process (policy@1 = make_model(1)), its ready line and the token."""
    token = make_tenant("team-a")
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.ros.publisher_proc", hub_server.address, "team-a", token,
         "policy", "1", "--seed", "1", "--ttl", str(TTL)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).parents[2],
    )  # fmt: skip
    try:
        assert process.stdout is not None
        ready = json.loads(process.stdout.readline() or "null")
        assert ready, "the publisher process did not publish"
        yield process, ready, token
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)  # a stopped process ignores SIGTERM's end
            assert process.stdin is not None
            process.stdin.close()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)


@pytest.mark.timeout(90)
def test_readers_of_a_frozen_sole_holder_fail_named_in_time_and_it_recovers_after_sigcont(
    hub_server: HubServer, holder: tuple[subprocess.Popen[str], dict[str, object], str]
) -> None:
    """Proves the three points of the module docstring, in order: two readers waiting on
    the frozen holder (deadlines 4 s and 30 s) each get a named `TensorHubError` within
    their deadline, the second long before it (`UNAVAILABLE_WITHIN`); after its
    lease expired a fetch with a 30 s deadline is refused `VersionUnavailable` within a few
    seconds; after SIGCONT the holder is registered again under a new session and a reader
    gets its exact bytes."""
    process, ready, token = holder
    clients = [
        ros.connect(hub_server.address, tenant="team-a", token=token, session_ttl=10)
        for _ in range(3)
    ]
    try:
        (before,) = clients[0].holders("policy", 1)
        assert before.holder == ready["holder"]
        os.kill(process.pid, signal.SIGSTOP)
        results: list[tuple[float, float, object]] = []

        def read(client: ros.Hub, timeout: float) -> None:
            start = time.monotonic()
            try:
                outcome: object = client.fetch("policy", 1, timeout=timeout)
            except Exception as exc:
                outcome = exc
            results.append((timeout, time.monotonic() - start, outcome))

        threads = [
            threading.Thread(target=read, args=(clients[0], READ_DEADLINE)),
            threading.Thread(target=read, args=(clients[1], LONG_DEADLINE)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(LONG_DEADLINE + 30)
        assert len(results) == 2, "a reader of the frozen holder hung"
        for timeout, took, outcome in results:
            assert isinstance(outcome, ros.TensorHubError), outcome  # named, not a bare error
            assert took <= min(timeout, UNAVAILABLE_WITHIN) + SLACK, (timeout, took, outcome)

        def publisher_record() -> list[HolderRecord]:
            """The publisher's record (a waiting reader's PARTIAL one may outlive its fetch:
            under load its cleanup is left to its session, as docs/sdk.md says)."""
            return [h for h in clients[2].holders("policy", 1) if h.holder == ready["holder"]]

        wait_until(  # the frozen holder cannot renew: its lease, and its record, go
            "the frozen holder's record expired",
            lambda: not publisher_record(),
            timeout=TTL + 10,
        )
        start = time.monotonic()
        with pytest.raises(ros.VersionUnavailable):
            clients[2].fetch("policy", 1, timeout=30)
        assert time.monotonic() - start <= SLACK, "a version nobody holds kept a reader waiting"
        assert clients[2].latest("policy") == 1  # the version itself is still published

        os.kill(process.pid, signal.SIGCONT)
        wait_until(
            "the thawed holder registered policy@1 again",
            lambda: bool(publisher_record()),
            timeout=20,
        )
        (record,) = publisher_record()
        assert record.session != before.session  # a new session: the frozen one's lease is gone
        assert record.complete
        held = clients[2].fetch("policy", 1, timeout=30)
        assert digest(held.tensors) == digest(make_model(1))
        assert process.poll() is None
    finally:
        for client in clients:
            client.close()
