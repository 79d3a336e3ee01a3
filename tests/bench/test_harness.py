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
def test_a_fair_upload_queues_each_address_apart_under_the_tbf() -> None:
    with Emulation({1: 2}, 100.0, fair=True) as emu:
        a, b = emu.hosts
        tc = ["ip", "netns", "exec", a.ns, "tc"]
        qdisc = subprocess.run([*tc, "qdisc", "show", "dev", "eth0"], capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
        assert "qdisc tbf 1: root" in qdisc
        assert "qdisc htb 10: parent 1:1" in qdisc
        probe = f"import socket; socket.create_connection(('{b.ip}', 9), 2)"
        subprocess.run(emu.exec_argv(a, ["python3", "-c", probe]), capture_output=True, check=False)
        classes = subprocess.run([*tc, "-s", "class", "show", "dev", "eth0"],
                                 capture_output=True, text=True, check=True).stdout  # fmt: skip
        sent = {
            block.split()[0]: int(block.split("Sent ")[1].split()[0])
            for block in classes.split("class htb ")[1:]
        }
        # a's, b's, the gateway's queue, and one for any other address; the SYN went to b's
        assert sorted(sent) == ["10:1", "10:2", "10:3", "10:4"]
        assert sent["10:2"] > 0
        assert sent["10:1"] == 0
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
