"""deploy/ray/weight_sync.py on a real two-node Ray cluster, against a real hub and etcd.

The example runs as a user runs it (a script, joining the cluster with --ray-address): a
trainer actor publishes every version, three rollout actors fetch each in place and serve
each other, one of them is killed with ray.kill mid-run (holding the latest version) and
replaced by a new actor on its node, which catches up past the dead holder's record. Then
it runs again on the same tenant, which must continue the model's versions instead of
failing on the first run's (the bug of the first version of the example: VersionNotFound).
The first run uses delta versions (the default: after the first step the rollouts read only
the changes), the second `--no-delta` (every fetch reads the whole model).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ros
from ros.hub.server import HubServer
from tests.engines.ray.conftest import HEAD_IP, WORKER_IP, example_env

EXAMPLE = Path(__file__).resolve().parents[3] / "deploy" / "ray" / "weight_sync.py"
TENANT = "team-ray"
ROLLOUTS = 3
STEPS = 4
KILL_AT = 2
MODEL_MB = 2.0
RUN_TIMEOUT = 110  # one run of the example, including its actors' start


def example(
    address: str, hub: str, token: str, out: Path, rollouts: int = ROLLOUTS, *more: str
) -> subprocess.CompletedProcess[str]:
    env = {**example_env(), "TENSORHUB_TOKEN": token}  # the token off the command line
    return subprocess.run(
        [sys.executable, str(EXAMPLE), "--ray-address", address, "--hub", hub,
         "--tenant", TENANT, "--rollouts", str(rollouts), "--steps", str(STEPS),
         "--kill-at", str(KILL_AT), "--model-mb", str(MODEL_MB), "--step-timeout", "60",
         "--json", str(out), *more],
        env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False,
    )  # fmt: skip


def run_example(address: str, hub: str, token: str, out: Path, *more: str) -> dict[str, Any]:
    proc = example(address, hub, token, out, ROLLOUTS, *more)
    print(proc.stdout)  # the run's table, shown by pytest on failure (or with -s)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    summary: dict[str, Any] = json.loads(out.read_text())
    return summary


def check_run(summary: dict[str, Any], first: int, delta: bool) -> None:
    """One run's outcome: this run's versions, every step's bytes the trainer's, the killed
    rollout replaced on its node and caught up, every live rollout on the final bytes, and
    what moved: with `delta`, the changes only after the first step; without, everything."""
    assert summary["ok"]
    assert summary["first_version"] == first
    assert summary["last_version"] == first + STEPS - 1
    steps = summary["steps"]
    assert [s["version"] for s in steps] == list(range(first, first + STEPS))
    assert sorted(summary["nodes"]) == sorted([HEAD_IP, WORKER_IP])
    assert summary["trainer_node"] == HEAD_IP
    nodes = {r["name"]: r["node"] for s in steps for r in s["rollouts"]}
    assert set(nodes.values()) == {HEAD_IP, WORKER_IP}  # actors on both nodes
    for s in steps:
        reports = s["rollouts"] + ([s["replacement"]] if s["replacement"] else [])
        assert {r["digest"] for r in reports} == {s["trainer"]["digest"]}, s
        assert {r["version"] for r in reports} == {s["version"]}, s
    killed = steps[KILL_AT - 1]
    assert killed["killed"] == "rollout-0"  # after it loaded that step's version
    assert "rollout-0" in {r["name"] for r in killed["rollouts"]}
    assert not any(s["killed"] for s in steps if s is not killed)
    assert "rollout-0" not in {r["name"] for s in steps[KILL_AT:] for r in s["rollouts"]}
    replacement = killed["replacement"]
    assert replacement["name"] == f"rollout-{ROLLOUTS}"
    assert replacement["node"] == nodes["rollout-0"]  # started where the victim ran
    assert replacement["version"] == killed["version"]  # caught up to the latest
    for s in steps[KILL_AT:]:  # and followed the run from then on
        assert replacement["name"] in {r["name"] for r in s["rollouts"]}
    final = summary["final"]
    assert set(final) == {f"rollout-{i}" for i in range(1, ROLLOUTS + 1)}
    last = steps[-1]["trainer"]
    assert {r["version"] for r in final.values()} == {last["version"]}
    assert {r["digest"] for r in final.values()} == {last["digest"]}
    reports = [r for s in steps for r in s["rollouts"]]
    assert sum(r["from_peers"] + r["delta_bytes"] for r in reports) > 0  # from the trainer
    whole = MODEL_MB * 2**20 * 0.99  # the model (its width is rounded down)
    first_step = [r["from_trainer"] + r["from_peers"] for r in steps[0]["rollouts"]]
    assert all(n >= whole for n in first_step)  # no base yet: read whole
    assert replacement["delta_chunks"] == 0  # a newcomer has no base either
    later = [r for s in steps[1:] for r in s["rollouts"]]
    moved = sum(r["from_trainer"] + r["from_peers"] + r["delta_bytes"] for r in later)
    if not delta:
        assert all(r["delta_chunks"] == 0 for r in reports)
        assert all(r["delta_bytes"] == 0 for r in reports)
        assert moved >= len(later) * whole  # every fetch read the whole model
        return
    for s in steps[1:]:  # each rollout's memory held the version before: the delta applies
        assert any(r["delta_chunks"] > 0 for r in s["rollouts"]), s
    # (a rollout whose delta could not be read, e.g. its only holder gone, reads whole)
    assert moved < len(later) * whole / 4, later


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT + 30)
def test_two_runs_on_one_tenant_with_a_rollout_killed_and_replaced(
    ray_cluster: str,
    hub_server: HubServer,
    make_tenant: Callable[[str], str],
    tmp_path: Path,
) -> None:
    token = make_tenant(TENANT)
    first = run_example(ray_cluster, hub_server.address, token, tmp_path / "run1.json")
    check_run(first, 1, delta=True)
    second = run_example(
        ray_cluster, hub_server.address, token, tmp_path / "run2.json", "--no-delta"
    )
    check_run(second, STEPS + 1, delta=False)  # continues after the first run's versions
    assert second["steps"][-1]["trainer"]["digest"] != first["steps"][-1]["trainer"]["digest"]
    with ros.connect(hub_server.address, tenant=TENANT, token=token) as hub:
        assert hub.latest("policy") == 2 * STEPS


@pytest.mark.timeout(60)
def test_help_documents_the_flags() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--help"],
        env=example_env(), capture_output=True, text=True, timeout=50, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    flags = ["--hub", "--tenant", "--token", "--ray-address", "--rollouts", "--steps"]
    flags += ["--model-mb", "--kill-at", "--step-timeout", "--json", "TENSORHUB_TOKEN"]
    flags += ["--no-delta"]
    for flag in flags:
        assert flag in proc.stdout, flag


@pytest.mark.timeout(RUN_TIMEOUT + 10)
def test_a_refused_token_fails_the_run_with_the_sdks_error(
    ray_cluster: str, hub_server: HubServer, make_tenant: Callable[[str], str], tmp_path: Path
) -> None:
    token = make_tenant(TENANT)
    proc = example(ray_cluster, hub_server.address, token + "x", tmp_path / "run.json", 1)
    assert proc.returncode == 1, proc.stdout
    assert "weight sync failed: PermissionDenied" in proc.stderr, proc.stderr[-4000:]
    assert not (tmp_path / "run.json").exists()
    with ros.connect(hub_server.address, tenant=TENANT, token=token) as hub:
        assert hub.latest("policy") == 0  # nothing was published
