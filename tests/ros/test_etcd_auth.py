"""The hub over an etcd with auth on: what the dev etcd of `tensorhub serve` now is.

The attack (issue 12, item 15): any local process dials the embedded etcd on loopback and
reads the hub secret, from which every tenant's read keys derive. Here that process gets
"user name is empty" for every key, while the hub, which alone has root's password, serves a
publish and a fetch end to end. The same hub reaches a production etcd with auth through
`--etcd-user` and `--etcd-password-file`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import etcd3
import grpc
import pytest

import ros
from consistency import EtcdCluster, Keys
from ros.hub.server import HubServer
from ros.hub.tenants import TenantStore
from tests.ros.helpers import digest, make_model

ADMIN = "etcd-auth-admin"


def _unauthenticated_reads(endpoint: str, secret_key: str) -> list[str]:
    """What a plain local etcd client, with no password, gets: the refusals it saw."""
    host, port = endpoint.rsplit(":", 1)
    plain = etcd3.client(host=host, port=int(port), timeout=5)
    refusals = []
    try:
        for attempt in (
            lambda: plain.get(secret_key),
            lambda: list(plain.get_prefix("/")),
            lambda: plain.put(secret_key, "planted"),
        ):
            try:
                attempt()
            except grpc.RpcError as exc:
                refusals.append(exc.details() or "")
    finally:
        plain.close()
    return refusals


def _publish_and_fetch(address: str, token: str) -> None:
    weights = make_model(7)
    with (
        ros.connect(address, tenant="team-a", token=token, name="trainer") as trainer,
        ros.connect(address, tenant="team-a", token=token, name="reader") as reader,
    ):
        trainer.publish("policy", 1, weights)
        held = reader.fetch("policy", 1, timeout=20)
        assert digest(held.tensors) == digest(weights)


@pytest.fixture(scope="module")
def auth_etcd() -> Iterator[EtcdCluster]:
    with EtcdCluster(size=1, auth=True) as cluster:
        yield cluster


@pytest.mark.timeout(90)
def test_a_local_process_cannot_read_the_hub_secret_and_the_hub_still_serves(
    auth_etcd: EtcdCluster,
) -> None:
    keys = Keys(f"/auth-test/{os.getpid()}")
    server = HubServer(
        auth_etcd.endpoints, admin_token=ADMIN, keys=keys,
        etcd_credentials=auth_etcd.credentials,
    ).start()  # fmt: skip
    try:
        token = TenantStore(server.etcd, keys).create("team-a")
        _publish_and_fetch(server.address, token)
        kv, _ = server.etcd.get(keys.hub_secret())
        assert kv is not None  # the secret is there, for the hub
        refusals = _unauthenticated_reads(auth_etcd.endpoints[0], keys.hub_secret())
        assert refusals == ["etcdserver: user name is empty"] * 3
    finally:
        server.stop(grace=0.2)


def _serve(*args: str, env: dict[str, str], ready: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ros.cli", "serve", "--listen", "127.0.0.1:0",
         "--ready-file", str(ready), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **env},
    )  # fmt: skip


def _wait_ready(proc: subprocess.Popen[str], ready: Path) -> dict[str, object]:
    deadline = time.monotonic() + 40
    while not ready.exists():
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"serve exited with {proc.returncode}:\n{out}")
        assert time.monotonic() < deadline, "serve not ready within 40s"
        time.sleep(0.05)
    data: dict[str, object] = json.loads(ready.read_text())
    return data


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    return out


def _create_tenant(address: str) -> str:
    created = subprocess.run(
        [sys.executable, "-m", "ros.cli", "tenant", "create", "team-a", "--hub", address,
         "--json"],
        check=False, capture_output=True, text=True, timeout=60,
        env={**os.environ, "TENSORHUB_ADMIN_TOKEN": ADMIN},
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    token: str = json.loads(created.stdout)["token"]
    return token


@pytest.mark.timeout(120)
def test_serve_without_etcd_starts_an_etcd_only_the_hub_can_read(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    proc = _serve(env={"TENSORHUB_ADMIN_TOKEN": ADMIN}, ready=ready)
    try:
        address = str(_wait_ready(proc, ready)["address"])
        token = _create_tenant(address)  # the hub secret is written by now
        _publish_and_fetch(address, token)
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            assert b"password" not in f.read()  # not on the command line of any process
        endpoint = str(json.loads(ready.read_text())["etcd"][0])
        refusals = _unauthenticated_reads(endpoint, Keys().hub_secret())  # serve's default prefix
        assert refusals == ["etcdserver: user name is empty"] * 3
    finally:
        out = _stop(proc)
    assert re.search(r"embedded etcd at \S+ .*auth on", out), out


@pytest.mark.timeout(120)
def test_serve_reaches_an_etcd_with_auth_through_a_password_file(
    auth_etcd: EtcdCluster, tmp_path: Path
) -> None:
    password = auth_etcd.password_file()
    etcd = ",".join(auth_etcd.endpoints)
    prefix = f"/auth-serve/{os.getpid()}"
    ready = tmp_path / "ready.json"
    proc = _serve(
        "--etcd", etcd, "--prefix", prefix, "--etcd-user", "root",
        "--etcd-password-file", str(password), env={"TENSORHUB_ADMIN_TOKEN": ADMIN}, ready=ready,
    )  # fmt: skip
    try:
        address = str(_wait_ready(proc, ready)["address"])
        _publish_and_fetch(address, _create_tenant(address))
    finally:
        _stop(proc)
    # the password in the environment works too; a wrong one stops serve with a named error
    wrong = tmp_path / "wrong"
    wrong.write_text("guess\n")
    bad = subprocess.run(
        [sys.executable, "-m", "ros.cli", "serve", "--etcd", etcd, "--prefix", prefix,
         "--listen", "127.0.0.1:0", "--etcd-password-file", str(wrong)],
        check=False, capture_output=True, text=True, timeout=60,
        env={**os.environ, "TENSORHUB_ADMIN_TOKEN": ADMIN},
    )  # fmt: skip
    assert bad.returncode != 0
    assert "EtcdAuthFailed" in bad.stderr + bad.stdout
    assert "refused to authenticate user 'root'" in bad.stderr + bad.stdout
    assert auth_etcd.credentials is not None
    ready_env = tmp_path / "ready-env.json"
    proc = _serve(
        "--etcd", etcd, "--prefix", prefix, ready=ready_env,
        env={"TENSORHUB_ADMIN_TOKEN": ADMIN,
             "TENSORHUB_ETCD_PASSWORD": auth_etcd.credentials.password or ""},
    )  # fmt: skip
    try:
        _wait_ready(proc, ready_env)
    finally:
        _stop(proc)
    helped = subprocess.run(
        [sys.executable, "-m", "ros.cli", "serve", "--help"],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "--etcd-password-file" in helped.stdout
    assert "--etcd-password " not in helped.stdout  # no way to put it on a command line
