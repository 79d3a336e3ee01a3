"""deploy/systemd: `systemd-analyze verify` on every unit, failing on any line it prints.

verify exits 0 on an unknown key or a value it cannot parse (it logs the line and ignores
it), so any output is a finding here. It also refuses a unit whose ExecStart binary does not
exist; the binaries (the project's venv, etcdctl) are not installed on a test machine, so the
units are verified under a scratch --root holding systemd's own units, the unit files
themselves, and an empty executable at each ExecStart path. scripts/engine-deploy-check.post.sh
installs systemd-analyze (Debian's systemd package) when it is missing and it runs as root.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from ._tools import SYSTEMD, output, run

pytestmark = pytest.mark.timeout(60)

UNITS = sorted(p for p in SYSTEMD.iterdir() if p.suffix in {".service", ".timer"})
SYSTEM_UNITS = Path("/usr/lib/systemd/system")


def _analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.skip(
            "systemd-analyze is not installed (Debian package systemd; "
            "scripts/engine-deploy-check.post.sh installs it when run as root)"
        )
    if not SYSTEM_UNITS.is_dir():
        pytest.skip(f"{SYSTEM_UNITS} is missing: systemd's own units are needed to verify")
    return found


def _root(tmp_path: Path, units: list[Path]) -> tuple[Path, list[Path]]:
    root = tmp_path / "root"
    unit_dir = root / "etc/systemd/system"
    unit_dir.mkdir(parents=True)
    shutil.copytree(SYSTEM_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    copies = []
    for unit in units:
        text = unit.read_text()
        for binary in re.findall(r"^Exec\w+=[-@:+!]*(/\S+)", text, flags=re.MULTILINE):
            stub = root / binary.lstrip("/")
            stub.parent.mkdir(parents=True, exist_ok=True)
            stub.write_text("#!/bin/sh\n")
            stub.chmod(0o755)
        copy = unit_dir / unit.name
        copy.write_text(text)
        copies.append(copy)
    return root, copies


def test_units_exist() -> None:
    names = {u.name for u in UNITS}
    assert {"tensorhub-hub.service", "tensorhub-etcd-defrag.service"} <= names
    assert "tensorhub-etcd-defrag.timer" in names


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = _analyze()
    root, copies = _root(tmp_path, UNITS)
    proc = run([analyze, "verify", "--man=no", f"--root={root}", *copies], timeout=30)
    assert proc.returncode == 0, output(proc)
    assert not (proc.stdout + proc.stderr).strip(), output(proc)


def test_systemd_analyze_verify_reports_a_bad_unit(tmp_path: Path) -> None:
    """The check is not vacuous: an unknown key and a bad Restart= are printed."""
    analyze = _analyze()
    bad = tmp_path / "bad.service"
    bad.write_text("[Service]\nExecStart=/usr/bin/tensorhub\nRestartt=always\nRestart=often\n")
    root, copies = _root(tmp_path, [bad])
    proc = run([analyze, "verify", "--man=no", f"--root={root}", *copies], timeout=30)
    text = proc.stdout + proc.stderr
    assert "Restartt" in text, output(proc)
    assert "often" in text, output(proc)


def test_hub_unit_restarts_while_etcd_is_away() -> None:
    text = (SYSTEMD / "tensorhub-hub.service").read_text()
    assert "Restart=always" in text
    assert "StartLimitIntervalSec=0" in text  # `serve` exits after 5 s without etcd
    for flag in ("--etcd-user", "--etcd-password-file", "--etcd-ca", "--etcd-cert", "--etcd-key"):
        assert flag in text, flag
