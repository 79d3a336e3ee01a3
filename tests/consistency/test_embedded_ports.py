"""The embedded etcd's ports: `free_port` never hands this process the same port twice in a
row (CI once saw a member get one port for both its client and peer URLs), and a cluster
whose port another process took after it was found free starts again on new ports."""

from __future__ import annotations

import socket

import pytest

from consistency import EtcdCluster
from consistency.embedded import free_port
from tensorhub.errors import EtcdStartError


def test_free_port_hands_out_distinct_ports() -> None:
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


def test_a_port_taken_before_the_start_is_replaced() -> None:
    """Another process listens on the client port the member was given: etcd exits with
    "address already in use", and the start is made again, from nothing, on new ports."""
    cluster = EtcdCluster(size=1)
    member = cluster.members[0]
    taken = member.client_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with cluster:
            assert member.client_port != taken
            with cluster.client() as etcd:
                etcd.put("/ports/check", b"ok")
                kv, _ = etcd.get("/ports/check")
                assert kv is not None
                assert kv.value == b"ok"


def test_a_start_that_fails_for_good_leaves_no_member_running() -> None:
    """A member that is not healthy in time (a start deadline no etcd can meet) fails the
    start with the error naming its log, and no process of the cluster is left running."""
    cluster = EtcdCluster(size=3, start_timeout=0.001)
    with pytest.raises(EtcdStartError):
        cluster.start()
    try:
        assert all(not member.alive for member in cluster.members)
    finally:
        cluster.stop()
