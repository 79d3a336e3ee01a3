"""deploy/compose: the compose file against the compose-spec schema, its start-up order, and
the hub image (checkov's Dockerfile checks, and its health check run against a real hub).

The schema is the compose-spec JSON schema that check-jsonschema ships
(`--builtin-schema vendor.compose-spec`); what a schema cannot say (every service restarts,
has a health check, the hubs wait for healthy etcd members, no shell in the etcd image) is
asserted on the parsed YAML.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from ._tools import (
    COMPOSE,
    DOCKERFILE,
    ETCD_HISTORY_FLAGS,
    HEALTHCHECK,
    flags,
    help_flags,
    output,
    run,
    tool,
)

pytestmark = pytest.mark.timeout(120)


def _compose() -> dict[str, Any]:
    with COMPOSE.open() as f:
        return yaml.safe_load(f)  # type: ignore[no-any-return]


def _services(kind: str) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in _compose()["services"].items() if k.startswith(kind)}


def test_compose_spec_schema() -> None:
    proc = run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", COMPOSE])
    assert proc.returncode == 0, output(proc)


def test_compose_spec_schema_rejects_unknown_key(tmp_path: Path) -> None:
    """The schema check is not vacuous."""
    bad = tmp_path / "compose.yml"
    bad.write_text("services:\n  hub:\n    image: x\n    restart_policy: always\n")
    proc = run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", bad])
    assert proc.returncode != 0, output(proc)


def test_every_service_restarts_and_has_a_health_check() -> None:
    services = _compose()["services"]
    assert set(services) == {"etcd0", "etcd1", "etcd2", "hub0", "hub1"}
    for name, s in services.items():
        assert s["restart"] in {"always", "unless-stopped", "on-failure"}, name
        test = s["healthcheck"]["test"]
        assert test[0] == "CMD", f"{name}: exec form, no shell in the etcd image"
        assert s["healthcheck"]["start_period"], name


def test_hubs_wait_for_healthy_etcd() -> None:
    etcd = _services("etcd")
    for name, hub in _services("hub").items():
        assert hub["depends_on"] == {m: {"condition": "service_healthy"} for m in etcd}, name
        f = flags(hub["command"][1:])
        assert sorted(f["--etcd"].split(",")) == sorted(f"{m}:2379" for m in etcd), name
        assert "${TENSORHUB_ADMIN_TOKEN:?" in hub["environment"]["TENSORHUB_ADMIN_TOKEN"]


def test_etcd_members() -> None:
    etcd = _services("etcd")
    cluster = ",".join(f"{m}=http://{m}:2380" for m in etcd)
    for name, s in etcd.items():
        assert "@sha256:" in s["image"], name
        cmd = s["command"]
        assert isinstance(cmd, list), f"{name}: an argument list"
        assert cmd[0] == "/usr/local/bin/etcd", name
        f = flags(cmd[1:])
        for k, v in ETCD_HISTORY_FLAGS.items():
            assert f.get(k) == v, (name, k)
        assert f["--name"] == name
        assert f["--initial-cluster"] == cluster
        assert f["--data-dir"].startswith(s["volumes"][0].split(":")[1] + "/"), name
        # The health check reads this member's own client URL.
        assert "--endpoints=http://127.0.0.1:2379" in s["healthcheck"]["test"]
    proc = run([tool("etcd"), "--help"], timeout=30)
    known = help_flags(proc.stdout + proc.stderr)
    for s in etcd.values():
        assert set(flags(s["command"][1:])) <= known
    ctl = run([tool("etcdctl"), "endpoint", "health", "--help"], timeout=30)
    used = {a.split("=")[0] for a in s["healthcheck"]["test"] if a.startswith("--")}
    assert used <= help_flags(ctl.stdout), output(ctl)


def test_hub_flags_exist() -> None:
    proc = run([tool("tensorhub"), "serve", "--help"], timeout=60)
    for name, hub in _services("hub").items():
        assert hub["command"][0] == "serve"
        used = set(flags(hub["command"][1:]))
        assert used <= help_flags(proc.stdout), (name, used - help_flags(proc.stdout))


def test_checkov_dockerfile() -> None:
    proc = run(
        [
            *(tool("checkov"), "-f", DOCKERFILE, "--framework", "dockerfile"),
            *("--skip-download", "-o", "json"),
        ],
        timeout=110,
    )
    report = json.loads(proc.stdout)
    failed = [f"{c['check_id']}: {c['check_name']}" for c in report["results"]["failed_checks"]]
    assert not failed, "checkov findings:\n" + "\n".join(failed)
    assert not report["results"]["skipped_checks"]
    assert report["summary"]["passed"] > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_hub_health_check_against_a_real_hub(tmp_path: Path) -> None:
    """deploy/compose/healthcheck.py (the image's HEALTHCHECK and compose's) on a real hub:
    exit 1 while nothing listens, 0 once `tensorhub serve` serves, 1 after it stops.

    The hub binds port 0 and the test reads the port it got from the ready file: a port picked
    free beforehand can be taken by then (the embedded etcd's own connections draw their
    source ports from the same range), and the hub then fails to bind."""
    nothing = f"127.0.0.1:{_free_port()}"
    down = run([sys.executable, HEALTHCHECK, nothing], timeout=30)
    assert down.returncode == 1, output(down)
    ready = tmp_path / "ready.json"
    hub = subprocess.Popen(
        [tool("tensorhub"), "serve", "--listen", "127.0.0.1:0", "--ready-file", ready],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "TENSORHUB_ADMIN_TOKEN": "deploy-check-admin-token"},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert hub.poll() is None, hub.stderr.read().decode() if hub.stderr else ""
            assert time.monotonic() < deadline, "the hub did not start in 60 s"
            time.sleep(0.2)
        address = str(json.loads(ready.read_text())["address"])
        assert not address.endswith(":0"), address
        up = run([sys.executable, HEALTHCHECK, address], timeout=30)
        assert up.returncode == 0, output(up)
    finally:
        if hub.poll() is None:
            os.killpg(hub.pid, signal.SIGTERM)
        try:
            hub.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(hub.pid, signal.SIGKILL)
            hub.wait()
    after = run([sys.executable, HEALTHCHECK, address], timeout=30)
    assert after.returncode == 1, output(after)
