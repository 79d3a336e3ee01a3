"""TLS is a configuration away: hub over TLS, data plane over mutual TLS."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import ros
from consistency import EtcdCluster, Keys
from ros.hub.server import HubServer
from ros.hub.tenants import TenantStore
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tests.ros.helpers import digest, make_model
from transport.layout import Layout
from transport.planner import Source
from transport.reader import fetch
from transport.store import HeldVersion
from transport.tls import TlsConfig
from transport.topology import Topology


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(root: Path, name: str) -> TlsConfig:
    """A CA and one certificate it signs (for 127.0.0.1), written under root/name."""
    d = root / name
    d.mkdir()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "1", "-subj", f"/CN={name}-ca", cwd=d)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr",
             "-subj", "/CN=localhost", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "node.pem", "-days", "1", "-extfile", "san.ext",
             cwd=d)  # fmt: skip
    return TlsConfig(ca=str(d / "ca.pem"), cert=str(d / "node.pem"), key=str(d / "node.key"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[TlsConfig, TlsConfig]:
    root = tmp_path_factory.mktemp("pki")
    return make_pki(root, "ours"), make_pki(root, "theirs")


@pytest.fixture
def tls_hub(
    etcd_cluster: EtcdCluster, keys: Keys, pki: tuple[TlsConfig, TlsConfig]
) -> Iterator[HubServer]:
    ours, _ = pki
    credentials = grpc.ssl_server_credentials(
        [(Path(ours.key).read_bytes(), Path(ours.cert).read_bytes())]
    )
    server = HubServer(etcd_cluster.endpoints, admin_token="a", keys=keys, credentials=credentials)
    yield server.start()
    server.stop(grace=0.2)


@pytest.mark.timeout(60)
def test_publish_and_fetch_over_tls(tls_hub: HubServer, pki: tuple[TlsConfig, TlsConfig]) -> None:
    ours, theirs = pki
    token = TenantStore(tls_hub.etcd, tls_hub.keys).create("team-a")
    weights = make_model(4)
    with (
        ros.connect(tls_hub.address, tenant="team-a", token=token, tls=ours) as trainer,
        ros.connect(tls_hub.address, tenant="team-a", token=token, tls=ours) as reader,
    ):
        pub = trainer.publish("policy", 1, weights)
        held = reader.fetch("policy", 1, timeout=20)
        assert digest(held.tensors) == digest(weights)
        assert pub.wait_replicated(1, timeout=10) == 1

        # The holder port speaks only TLS to peers with a certificate from our CA.
        layout = Layout.from_tensors(weights)
        host, port = trainer._serving.server.address
        source = [Source(trainer.holder_name, host, port, Topology())]
        resolved = reader._rpc("Resolve", pb.ResolveRequest(model="policy", version=1))
        read_token = bytes(resolved.read_token)

        def raw_fetch(tls: TlsConfig | None) -> None:
            dest = HeldVersion.reader("team-a", "policy", 1, layout, layout.allocate())
            fetch("team-a", "policy", 1, layout, dest, source, token=read_token,
                  deadline=time.monotonic() + 5, me=Topology(), tls=tls)  # fmt: skip

        listed = subprocess.run(
            [sys.executable, "-m", "ros.cli", "ls", "--hub", tls_hub.address, "--token", token,
             "--tls-ca", ours.ca, "--json"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert listed.returncode == 0, listed.stderr
        assert json.loads(listed.stdout)["models"][0]["model"] == "policy"

        raw_fetch(ours)  # control: the right CA and certificate read fine
        with pytest.raises(ros.TensorHubError):
            raw_fetch(None)  # plain TCP
        with pytest.raises(ros.TensorHubError):
            raw_fetch(theirs)  # a certificate from another CA

    # and a client that does not trust the hub's CA cannot even connect
    with pytest.raises(ros.TensorHubError):
        ros.connect(tls_hub.address, tenant="team-a", token=token, tls=theirs, timeout=3)


def _refused(address: tuple[str, int]) -> bool:
    """Whether nothing listens at `address` any more."""
    try:
        socket.create_connection(address, timeout=2).close()
    except OSError:
        return True
    return False


@pytest.mark.timeout(120)
def test_two_clients_in_one_process_each_own_their_servers(
    tls_hub: HubServer, hub_server: HubServer, pki: tuple[TlsConfig, TlsConfig]
) -> None:
    """A client with TLS and one without, in one process, serve from servers of their own
    (the backends are the client's, not the module's): closing either one stops its own
    port only, and a fetch from the other still works."""
    ours, _ = pki
    token = TenantStore(tls_hub.etcd, tls_hub.keys).create("team-a")
    weights = make_model(3)

    def secure_client() -> ros.Hub:
        return ros.connect(tls_hub.address, tenant="team-a", token=token, tls=ours)

    def plain_client() -> ros.Hub:
        return ros.connect(hub_server.address, tenant="team-a", token=token)

    secure, plain = secure_client(), plain_client()
    try:
        secure.publish("secure", 1, weights)
        plain.publish("plain", 1, weights)
        secure_at = secure._serving.server.address
        plain_at = plain._serving.server.address
        assert secure_at != plain_at
        secure.close()  # the TLS client goes: the plain one keeps serving
        assert _refused(secure_at)
        with plain_client() as reader:
            held = reader.fetch("plain", 1, timeout=20)
            assert digest(held.tensors) == digest(weights)
        secure = secure_client()  # and the other way round
        secure.publish("secure", 2, weights)
        plain.close()
        assert _refused(plain_at)
        with secure_client() as reader:
            held = reader.fetch("secure", 2, timeout=20)
            assert digest(held.tensors) == digest(weights)
    finally:
        secure.close()
        plain.close()
