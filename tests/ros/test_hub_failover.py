"""Two hub replicas as real processes: the one a client uses dies mid-watch.

Each client tries the replicas in its own random order (`ros.client.channel`), so the one
killed is found by its metrics: the replica serving the client's watch.

The client continues on the other replica with no missed or repeated watch event, its
session (lease) survives, and `latest` never goes backwards.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import ros
from consistency import Etcd, EtcdCluster, EventKind, Keys
from ros.hub.tenants import TenantStore
from tests.ros.helpers import make_model

ADMIN = "failover-admin"


def start_hub(
    etcd_cluster: EtcdCluster, keys: Keys, ready: Path
) -> tuple[subprocess.Popen[bytes], str, int]:
    """A hub process; its address and the metrics port it chose (`--metrics-port 0`: a port
    picked here could be taken by another process before the hub binds it)."""
    log = ready.with_suffix(".log")
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ros.cli", "serve", "--listen", "127.0.0.1:0",
             "--etcd", ",".join(etcd_cluster.endpoints), "--admin-token", ADMIN,
             "--prefix", keys.prefix, "--ready-file", str(ready), "--metrics-port", "0"],
            stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert proc.poll() is None, f"hub exited during start-up: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, "hub did not start in 30 s"
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return proc, info["address"], int(info["metrics"].rsplit(":", 1)[1])


def watches(metrics_port: int) -> float:
    """Watch streams the replica serving metrics on this port has open now."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("tensorhub_hub_watches_active "):
                return float(line.split()[1])
    return 0.0


@pytest.fixture
def two_hubs(
    etcd_cluster: EtcdCluster, keys: Keys, tmp_path: Path
) -> Iterator[list[tuple[subprocess.Popen[bytes], str, int]]]:
    hubs = []
    for i in range(2):
        ready = tmp_path / f"hub{i}.json"
        hubs.append(start_hub(etcd_cluster, keys, ready))
    yield hubs
    for proc, _, _ in hubs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.mark.timeout(120)
def test_client_survives_the_death_of_its_hub_replica(
    two_hubs: list[tuple[subprocess.Popen[bytes], str, int]],
    etcd_cluster: EtcdCluster,
    keys: Keys,
) -> None:
    with Etcd(etcd_cluster.endpoints) as etcd:
        token = TenantStore(etcd, keys).create("team-a")
    addresses = [address for _, address, _ in two_hubs]
    publisher = ros.connect(addresses, tenant="team-a", token=token, session_ttl=3)
    client = ros.connect(addresses, tenant="team-a", token=token, session_ttl=3)
    try:
        publisher.publish("policy", 1, make_model(1))
        held = client.fetch("policy", 1)
        watch = client.watch("policy")
        deadline = time.monotonic() + 10
        while not (serving := [p for p, _, port in two_hubs if watches(port) >= 1]):
            assert time.monotonic() < deadline, "the client's watch reached no replica"
            time.sleep(0.05)
        (first,) = serving  # the replica the client uses: the one to kill
        seen_latest = [client.latest("policy")]
        published = []
        killed_at = None
        for version in range(2, 12):
            if version == 6:
                first.send_signal(signal.SIGKILL)
                first.wait(timeout=10)
                killed_at = time.monotonic()
            publication = publisher.publish("policy", version, make_model(version))
            if version < 11:
                publication.release(force=True)
            published.append(version)
            seen_latest.append(client.latest("policy"))
        versions_seen: list[int] = []
        deadline = time.monotonic() + 30
        while len(versions_seen) < len(published) and time.monotonic() < deadline:
            event = watch.get(timeout=1)
            if event is not None and event.kind is EventKind.VERSION_PUBLISHED:
                versions_seen.append(event.version)
        watch.close()
        assert versions_seen == published, "watch events lost or repeated across the failover"
        assert seen_latest == sorted(seen_latest), f"latest went backwards: {seen_latest}"
        assert seen_latest[-1] == 11
        assert watch.reconnects >= 1
        # The session outlived its 3 s TTL across the failover: the hub still accepts records
        # under it (it checks that the lease is one of the tenant's live sessions).
        assert killed_at is not None
        time.sleep(max(0.0, 3.5 - (time.monotonic() - killed_at)))
        assert not client.session.lost.is_set()
        held.release(force=True)
        latest = client.fetch("policy", 11)
        assert client.holder_name in [h.holder for h in client.holders("policy", 11)]
        latest.release(force=True)
    finally:
        client.close()
        publisher.close()
