"""The SDK talks to the hub only: importing it (`import ros`, `ros.Hub`, every module of
`ros.client`) loads neither the etcd client (`etcd3`) nor the embedded etcd launcher
(`consistency.embedded`), checked in a fresh interpreter's `sys.modules`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import importlib, json, pkgutil, sys
import ros
ros.Hub  # the lazy SDK entry point
import ros.client
for module in pkgutil.iter_modules(ros.client.__path__, "ros.client."):
    importlib.import_module(module.name)
print(json.dumps(sorted(sys.modules)))
"""


@pytest.fixture(scope="module")
def loaded() -> set[str]:
    """The modules a fresh interpreter holds once it imported every module of the SDK."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_sdk_loads_neither_the_etcd_client_nor_the_embedded_launcher(
    loaded: set[str],
) -> None:
    assert "ros.client.hub" in loaded  # the probe did import the SDK
    assert not {m for m in loaded if m == "etcd3" or m.startswith("etcd3.")}
    assert "consistency.embedded" not in loaded
    assert "consistency.etcd" not in loaded


def test_the_sdk_does_not_load_dtensors_for_a_plain_publisher(loaded: set[str]) -> None:
    """torch.distributed.tensor costs a second or more to import (16 ranks of a chaos run on
    2 cores started publishing about 8 s later): the SDK looks for DTensors only where their
    module is already loaded, as it must be for a state dict to hold one."""
    assert "ros.client.dtensors" in loaded
    assert "torch.distributed.tensor" not in loaded
