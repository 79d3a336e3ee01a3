"""The emulated-host harness: namespaces are created, shaped, and removed — also after an
exception. Needs root; skipped otherwise (with that reason)."""

from __future__ import annotations

import os
import subprocess

import pytest

from bench.emu.netns import Emulation, NeedsRoot, namespaces

root = pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts need root (netns, tc)")


def _mine() -> list[str]:
    return [ns for ns in namespaces() if ns.startswith(f"thb-{os.getpid()}-")]


@root
def test_namespaces_created_shaped_and_removed() -> None:
    with Emulation({1: 2}, 100.0) as emu:
        assert len(_mine()) == 2
        a, b = emu.hosts
        qdisc = subprocess.run(
            ["ip", "netns", "exec", a.ns, "tc", "qdisc", "show", "dev", "eth0"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert "tbf" in qdisc
        probe = f"import socket; socket.create_connection(('{b.ip}', 9), 2)"
        reach = subprocess.run(
            emu.exec_argv(a, ["python3", "-c", probe]), capture_output=True, text=True, check=False
        )
        assert "ConnectionRefused" in reach.stderr  # b answered (RST): the bridge works
    assert _mine() == []


@root
def test_removed_after_an_exception() -> None:
    seen: list[int] = []

    def crash() -> None:
        with Emulation({1: 1, 2: 1}, 100.0, 20.0):
            seen.append(len(_mine()))
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        crash()
    assert seen == [3]  # two hosts and the router existed
    assert _mine() == []


def test_refuses_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NeedsRoot), Emulation({1: 1}, 100.0):
        pass
