"""The chaos cluster's hubs start every time (issue 11: 'hub 0 did not start' at once).

Two causes, each reproduced here from outside: an admin token beginning with "-" (argparse
took it for an option and `tensorhub serve` exited), and a hub port chosen free beforehand
that another process took before the hub bound it (at start-up, or while a killed hub was
down). A real etcd member and real `tensorhub serve` processes; a few seconds.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chaos import cluster as chaos_cluster
from chaos.cluster import ChaosCluster


@pytest.fixture
def taken() -> Iterator[socket.socket]:
    """A listening socket on a loopback port: a port somebody else got first."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield s


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=10, wait_for_ready=True)
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@pytest.mark.timeout(90)
def test_hubs_start_when_the_admin_token_begins_with_a_dash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`secrets.token_urlsafe` begins with "-" one time in 64; every hub got it as a word
    of its own after `--admin-token`, so hub 0 exited with a usage error."""
    real = secrets.token_urlsafe
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: "-" + real(n))
    cluster = ChaosCluster(tmp_path, hubs=2, etcd_members=1)
    try:
        cluster.start()
        assert cluster.admin.startswith("-")
        assert all(h.alive for h in cluster.hubs)
        assert _serving(cluster.hub_addresses[0])
    finally:
        cluster.close()


@pytest.mark.timeout(90)
def test_a_hub_starts_and_restarts_although_the_port_picked_for_it_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, taken: socket.socket
) -> None:
    port = taken.getsockname()[1]
    # The old cluster chose each hub's port with `free_port()` and passed it on; make that
    # choice the taken port, as when another process binds it in between. (The fixed
    # cluster binds port 0 in the hub, and no longer calls it.)
    monkeypatch.setattr(chaos_cluster, "free_port", lambda *a: port, raising=False)
    cluster = ChaosCluster(tmp_path, hubs=1, etcd_members=1)
    try:
        cluster.start()
        hub = cluster.hubs[0]
        assert hub.alive
        assert hub.port not in (0, port)
        assert _serving(cluster.hub_addresses[0])
        # kill-hub: while the hub is down another process takes the port it had.
        first = hub.port
        hub.kill()
        with socket.create_server(("127.0.0.1", first)):
            cluster.restart_hub(0)
            assert hub.alive
            assert hub.port != first
            # The clients' address (the proxy) is the same and reaches the new incarnation.
            assert _serving(cluster.hub_addresses[0])
    finally:
        cluster.close()
