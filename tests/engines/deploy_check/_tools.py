"""What the deploy checks share: where deploy/ is, its files parsed, and the validators.

Every validator runs as a real subprocess over the real files in deploy/. The tools come from
the environment running the tests (.venv-deploy-check, built by `scripts/venv.sh
deploy-check`); a test whose tool is missing there is skipped with the reason.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
COMPOSE = DEPLOY / "compose" / "docker-compose.yml"
DOCKERFILE = DEPLOY / "compose" / "Dockerfile"
HEALTHCHECK = DEPLOY / "compose" / "healthcheck.py"
SYSTEMD = DEPLOY / "systemd"

# The manifests `kubectl apply -k deploy/kubernetes` applies (kustomization.yaml lists them).
MANIFESTS = ["namespace.yaml", "etcd.yaml", "etcd-auth.yaml", "jobs-networkpolicy.yaml", "hub.yaml"]

# Kubernetes versions the manifests are validated against (deploy/README.md says the same).
KUBERNETES_VERSIONS = ["1.35.0", "1.36.0", "1.37.0"]

BIN = Path(sys.executable).parent

# The flags of etcd that docs/hub.md and deploy/README.md expect in every etcd deploy/ starts.
ETCD_HISTORY_FLAGS = {
    "--quota-backend-bytes": "4294967296",
    "--auto-compaction-mode": "periodic",
    "--auto-compaction-retention": "1h",
}


def tool(name: str) -> Path:
    """The executable `name` of this environment (or of PATH), else skip the test."""
    found = BIN / name
    if found.exists():
        return found
    on_path = shutil.which(name)
    if on_path is None:
        pytest.skip(f"{name} is not installed here: run in .venv-deploy-check (make test-engines)")
    return Path(on_path)


def run(
    argv: Sequence[object], *, timeout: float = 90.0, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """Run argv to completion (no shell), capturing text output."""
    return subprocess.run(
        [str(a) for a in argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        **kwargs,
    )


def output(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


def documents(path: Path) -> list[dict[str, Any]]:
    """The YAML documents of a manifest file, empty ones left out."""
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d]


def resources() -> list[dict[str, Any]]:
    return [d for name in MANIFESTS for d in documents(KUBERNETES / name)]


def resource(kind: str, name: str) -> dict[str, Any]:
    for d in resources():
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise AssertionError(f"no {kind} {name} in deploy/kubernetes")


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    if workload["kind"] == "CronJob":
        return workload["spec"]["jobTemplate"]["spec"]["template"]["spec"]  # type: ignore[no-any-return]
    return workload["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def workloads() -> Iterator[dict[str, Any]]:
    for d in resources():
        if d["kind"] in {"Deployment", "StatefulSet", "Job", "CronJob", "DaemonSet"}:
            yield d


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def flags(args: Sequence[str]) -> dict[str, str]:
    """--name=value (or --name value) arguments as a dict; a bare --name maps to ''."""
    out: dict[str, str] = {}
    items = list(args)
    for i, a in enumerate(items):
        if not a.startswith("--"):
            continue
        if "=" in a:
            k, v = a.split("=", 1)
            out[k] = v
        elif i + 1 < len(items) and not items[i + 1].startswith("--"):
            out[a] = items[i + 1]
        else:
            out[a] = ""
    return out


def help_flags(text: str) -> set[str]:
    """Every --flag a --help text mentions."""
    return set(re.findall(r"--[a-z0-9][a-z0-9-]*", text))
