"""`tensorhub serve` housekeeping (issue 12, item 15): the admin token off the command line,
and the metrics port no more exposed than the hub. Real `serve` processes on loopback."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

import ros
from bench.scale.procs import descendants
from consistency import EtcdCluster, Keys
from consistency.spawner import parent_death_signal_available
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tests.ros.helpers import make_model
from tests.waiting import wait_until

TOKEN = "admin-token-from-a-file"


@contextmanager
def _serve(
    etcd_cluster: EtcdCluster, keys: Keys, tmp_path: Path, *flags: str
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A `tensorhub serve` with `flags`; yields its address and process, and ends it with
    SIGTERM, as an operator would. Its output goes to `_output(tmp_path)`, a file: a pipe
    nobody reads while it runs could fill and block it."""
    ready = tmp_path / "ready.json"
    ready.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TENSORHUB_ADMIN_TOKEN"}
    with (tmp_path / "serve.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ros.cli", "serve", "--listen", "127.0.0.1:0",
             "--etcd", ",".join(etcd_cluster.endpoints), "--prefix", keys.prefix,
             "--ready-file", str(ready), "--grace", "0.2", *flags],
            stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
    try:
        wait_until("serve is ready", lambda: ready.exists() or proc.poll() is not None, 30)
        assert proc.poll() is None, _output(tmp_path)
        yield json.loads(ready.read_text())["address"], proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise AssertionError(f"serve ignored SIGTERM for 30 s:\n{_output(tmp_path)}") from None


def _output(tmp_path: Path) -> str:
    """What the last `_serve` of this test printed."""
    return (tmp_path / "serve.log").read_text()


def _create_tenant(address: str, token: str, name: str) -> str:
    with grpc.insecure_channel(address) as channel:
        stub = hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
        reply = stub.CreateTenant(
            pb.CreateTenantRequest(name=name),
            metadata=(("authorization", f"Bearer {token}"),),
            timeout=10,
        )
    return str(reply.token)


@pytest.mark.timeout(90)
def test_the_admin_token_flag_warns_and_a_token_file_is_read(
    etcd_cluster: EtcdCluster, keys: Keys, tmp_path: Path
) -> None:
    token_file = tmp_path / "admin-token"
    token_file.write_text(f"{TOKEN}\n")
    token_file.chmod(0o600)
    with _serve(etcd_cluster, keys, tmp_path, "--admin-token-file", str(token_file)) as (
        address,
        _,
    ):
        assert _create_tenant(address, TOKEN, "team-file")
    out = _output(tmp_path)
    assert "visible to every local user" not in out
    assert TOKEN not in out  # neither generated nor printed

    with _serve(etcd_cluster, keys, tmp_path, "--admin-token", TOKEN) as (address, _):
        assert _create_tenant(address, TOKEN, "team-flag")  # still accepted, with a warning
    assert "visible to every local user" in _output(tmp_path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


@pytest.mark.timeout(60)
def test_metrics_bind_to_the_listen_host_by_default(
    etcd_cluster: EtcdCluster, keys: Keys, tmp_path: Path
) -> None:
    """With --listen 127.0.0.1:0 the metrics port answers on 127.0.0.1 only: 127.0.0.2 (also
    loopback, and reachable where the old 0.0.0.0 bind was) is refused."""
    with _serve(etcd_cluster, keys, tmp_path, "--metrics-port", "0"):
        # the port the hub chose; one picked here could be taken before the hub binds it
        port = int(json.loads((tmp_path / "ready.json").read_text())["metrics"].split(":")[1])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert b"tensorhub_hub_calls_refused_total" in reply.read()
        assert not _connects("127.0.0.2", port)


def test_serve_help_lists_the_new_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ros.cli", "serve", "--help"], capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    for flag in (
        "--admin-token-file", "--metrics-host", "--first-message-timeout",
        "--max-streams-per-connection", "--read-token-ttl",
    ):  # fmt: skip
        assert flag in out


@pytest.mark.timeout(90)
def test_read_token_ttl_sets_what_resolve_issues(
    etcd_cluster: EtcdCluster, keys: Keys, tmp_path: Path
) -> None:
    token_file = tmp_path / "admin-token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    flags = ("--admin-token-file", str(token_file), "--read-token-ttl", "7")
    with _serve(etcd_cluster, keys, tmp_path, *flags) as (address, _):
        tenant_token = _create_tenant(address, TOKEN, "team-ttl")
        with ros.connect(address, tenant="team-ttl", token=tenant_token) as hub:
            hub.publish("policy", 1, make_model(1))
            resolved = hub.resolve("policy", 1)
            left = resolved.token_expiry_unix - time.time()  # issued before now: <= 7
            assert 0 < left <= 7  # not the 300 s default


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_hub_killed_with_sigkill_leaves_no_checking_process(
    etcd_cluster: EtcdCluster, keys: Keys, tmp_path: Path
) -> None:
    """The manifest checking process (`--check-processes 1`, the default) and the fork
    server it comes from end with the hub, even when the hub is killed outright and
    cannot stop them: each worker waits on a pidfd of the hub (`tensorhub.fork_server.
    exit_with`)."""
    with _serve(etcd_cluster, keys, tmp_path, "--check-processes", "1") as (_, proc):
        helpers = descendants(proc.pid)
        assert helpers, "serve started no checking process"
        proc.kill()
        proc.wait(10)
        try:
            wait_until(
                "the hub's helper processes end",
                lambda: not any(_alive(p) for p in helpers),
                20,
            )
        finally:  # none outlives the test, whatever it found
            for p in helpers:
                if _alive(p):
                    os.kill(p, signal.SIGKILL)


@pytest.mark.skipif(
    not parent_death_signal_available(),
    reason="needs Linux and util-linux 2.33+ (setpriv --pdeathsig), which this machine lacks",
)
@pytest.mark.timeout(90)
def test_a_hub_killed_with_sigkill_leaves_no_embedded_etcd(tmp_path: Path) -> None:
    """`serve` without `--etcd` starts its own etcd member; killed outright, the hub cannot
    stop it, and the kernel does (`consistency/spawner.py`): the member's ports are free
    again, none of its processes left running for good."""
    ready = tmp_path / "ready.json"
    env = {k: v for k, v in os.environ.items() if k != "TENSORHUB_ADMIN_TOKEN"}
    with (tmp_path / "serve.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ros.cli", "serve", "--listen", "127.0.0.1:0",
             "--check-processes", "0", "--ready-file", str(ready)],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    etcd: list[int] = []
    try:
        wait_until("serve is ready", lambda: ready.exists() or proc.poll() is not None, 60)
        assert proc.poll() is None, _output(tmp_path)
        etcd = [p for p in descendants(proc.pid) if _comm(p) == "etcd"]
        assert len(etcd) == 1, f"serve's children: {descendants(proc.pid)}"
        proc.kill()
        proc.wait(10)
        wait_until("the embedded etcd ends with its hub", lambda: not _alive(etcd[0]), 10)
    finally:  # nothing outlives the test, whatever it found
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for p in etcd:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        data = re.search(r"\(data in (\S+);", _output(tmp_path))
        if data:  # the killed hub could not remove its member's temp dir
            shutil.rmtree(data.group(1), ignore_errors=True)


def _comm(pid: int) -> str:
    """The process's command name ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
