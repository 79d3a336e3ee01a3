"""UCX settings the NIXL tests run under, one set per mode (tests/transport/test_nixl.py,
tests/ros/test_nixl_sdk.py): UCX reads them when an agent is made, so a test sets them in
its own environment before making one and passes them to the processes it starts."""

from __future__ import annotations

import os

import pytest

UCX = {
    "tcp": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"},  # UCX's TCP transport, on loopback
    "cma": {"UCX_TLS": "cma,tcp", "UCX_NET_DEVICES": "lo"},  # same host: process_vm_readv
}


def use_ucx(mode: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Set `mode`'s UCX settings in this process (every other `UCX_*` removed); returned
    for the processes a test starts."""
    for name in list(os.environ):
        if name.startswith("UCX_"):
            monkeypatch.delenv(name)
    env = UCX[mode]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env
