"""Recovery after a lost session is supervised: it is tried again until it succeeds or the
client closes, and `close()` during a recovery leaves no session alive.

Before, a recovery tried `OpenSession` once: when that failed (the hub down, or refusing),
it logged and gave up, and the client stayed without a session (and so served nothing) for
good. Real hubs throughout: a hub process killed and started again on the same address, and
a tenant whose session quota is full at the moment of the recovery.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import ros
from consistency import Etcd, EtcdCluster, Keys
from ros.client.session import RECOVERY_JOIN_TIMEOUT
from ros.hub.server import HubServer
from ros.hub.tenants import Quotas, TenantStore
from tests.ros.helpers import make_model
from tests.waiting import wait_until

ADMIN = "recovery-admin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HubProcess:
    """One hub as a process on a fixed address, so that it can be killed and started again
    where its clients look for it."""

    def __init__(self, etcd_cluster: EtcdCluster, keys: Keys, tmp_path: Path) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self._args = [
            sys.executable, "-m", "ros.cli", "serve", "--listen", self.address,
            "--etcd", ",".join(etcd_cluster.endpoints), "--admin-token", ADMIN,
            "--prefix", keys.prefix,
        ]  # fmt: skip
        self._tmp = tmp_path
        self._starts = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._starts += 1
        ready = self._tmp / f"hub-{self._starts}.json"
        self.proc = subprocess.Popen(
            [*self._args, "--ready-file", str(ready)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_until("the hub process is serving", lambda: self._ready(ready), timeout=30)
        assert json.loads(ready.read_text())["address"] == self.address

    def _ready(self, ready: Path) -> bool:
        assert self.proc is not None
        assert self.proc.poll() is None, "the hub exited during start-up"
        return ready.exists()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture
def hub_process(etcd_cluster: EtcdCluster, keys: Keys, tmp_path: Path) -> Iterator[HubProcess]:
    hub = HubProcess(etcd_cluster, keys, tmp_path)
    hub.start()
    yield hub
    hub.stop()


def session_count(etcd: Etcd, keys: Keys, tenant: str) -> int:
    """The tenant's sessions alive in etcd: each one's mark lives on its lease."""
    return int(etcd.count(keys.sessions(tenant), timeout=5))


@pytest.mark.timeout(120)
def test_the_hub_down_during_recovery_then_back_the_client_recovers_and_serves(
    hub_process: HubProcess, etcd_cluster: EtcdCluster, keys: Keys
) -> None:
    with Etcd(etcd_cluster.endpoints) as etcd:
        token = TenantStore(etcd, keys).create("team-a")
    clients: list[ros.Hub] = []

    def connect(**kwargs: int) -> ros.Hub:
        client = ros.connect(hub_process.address, tenant="team-a", token=token, **kwargs)  # type: ignore[arg-type]
        clients.append(client)
        return client

    try:
        trainer = connect(session_ttl=60)  # outlives the outage
        reader = connect(session_ttl=2)
        published = trainer.publish("policy", 1, make_model(1))
        reader.fetch("policy", 1, timeout=30)
        lost = reader.session.id
        hub_process.kill()
        # no renewal reaches etcd: the reader's lease runs out, and its recovery meets no hub
        wait_until("the reader lost its session", reader.session.lost.is_set, timeout=30)
        wait_until("a recovery attempt failed", lambda: reader.session.failures >= 2, 30)
        assert reader.session.recovering
        hub_process.start()
        wait_until(
            "the reader recovered a session",
            lambda: reader.session.id != lost and not reader.session.lost.is_set(),
            timeout=30,
        )
        wait_until(
            "the reader's record is back",
            lambda: any(
                h.holder == reader.holder_name and h.session == reader.session.id and h.complete
                for h in trainer.holders("policy", 1)
            ),
            timeout=30,
        )
        published.release()  # the reader is another complete holder: retention allows it
        fresh = connect().fetch("policy", 1, timeout=30)  # only the reader serves it now
        assert set(fresh.stats.bytes_per_source) == {reader.holder_name}
        trainer.publish("policy", 2, make_model(2))
        assert reader.fetch("policy", 2, timeout=30).version == 2  # and it fetches again
    finally:
        for client in clients:
            client.close()


def quota_tenant(hub_server: HubServer, max_sessions: int) -> str:
    quotas = Quotas(max_sessions=max_sessions)
    return TenantStore(hub_server.etcd, hub_server.keys).create("team-q", quotas)


@pytest.mark.timeout(90)
def test_a_refused_open_session_is_tried_again_until_one_succeeds(
    hub_server: HubServer,
) -> None:
    token = quota_tenant(hub_server, max_sessions=2)

    def connect(ttl: int = 10) -> ros.Hub:
        return ros.connect(hub_server.address, tenant="team-q", token=token, session_ttl=ttl)

    with connect() as trainer, connect(ttl=60) as reader:  # renewals every 20 s: not here
        trainer.publish("policy", 1, make_model(1))
        reader.fetch("policy", 1, timeout=30)
        wait_until("the first renewal came back", lambda: reader.session.renewals >= 1)
        lost = reader.session.id
        hub_server.etcd.lease_revoke(lost)
        filler = connect()  # takes the freed place: the quota is full again
        trainer.publish("policy", 2, make_model(2))
        try:
            with pytest.raises(ros.SessionExpired):  # the reader learns of the loss now
                reader.fetch("policy", 2, timeout=10)
            wait_until("OpenSession was refused", lambda: reader.session.failures >= 1)
            assert reader.session.id == lost  # still without a session
        finally:
            filler.close()  # a place frees up: a later try succeeds
        wait_until(
            "the reader recovered a session",
            lambda: reader.session.id != lost and not reader.session.lost.is_set(),
            timeout=30,
        )
        wait_until(
            "the reader's record is back under the new session",
            lambda: any(
                h.holder == reader.holder_name and h.session == reader.session.id
                for h in trainer.holders("policy", 1)
            ),
        )


@pytest.mark.timeout(90)
def test_close_during_a_recovery_leaves_no_session_alive(hub_server: HubServer) -> None:
    token = quota_tenant(hub_server, max_sessions=2)

    def connect(ttl: int) -> ros.Hub:
        return ros.connect(hub_server.address, tenant="team-q", token=token, session_ttl=ttl)

    with connect(10) as trainer:
        reader = connect(2)
        trainer.publish("policy", 1, make_model(1))
        reader.fetch("policy", 1, timeout=30)
        wait_until("the first renewal came back", lambda: reader.session.renewals >= 1)
        hub_server.etcd.lease_revoke(reader.session.id)
        filler = connect(2)  # the quota stays full: the reader's recovery keeps failing
        wait_until("the reader lost its session", reader.session.lost.is_set, timeout=30)
        wait_until("a recovery attempt failed", lambda: reader.session.failures >= 1)
        filler.close()  # now a try may succeed at any moment, racing the close() below
        started = time.monotonic()
        reader.close()
        took = time.monotonic() - started
        # the documented bound (docs/sdk.md), with room for a loaded machine
        assert took < 1.0 + 2.0 + RECOVERY_JOIN_TIMEOUT + 5.0, f"close() took {took:.1f}s"
        assert not reader.session.recovering

        def sessions() -> int:
            return session_count(hub_server.etcd, hub_server.keys, "team-q")

        # whatever a recovery opened meanwhile is revoked, or left to expire unrenewed
        wait_until("only the trainer's session is left", lambda: sessions() == 1, timeout=10)
        time.sleep(3.0)  # past the reader's TTL: nothing renews a session of the reader
        assert sessions() == 1
        assert trainer.inspect("policy", 1).total_holders == 1
