"""The SDK talks to the hub only: importing it (`import ros`, `ros.Hub`, every module of
`ros.client`) loads neither the etcd client (`etcd3`) nor the embedded etcd launcher
(`consistency.embedded`), checked in a fresh interpreter's `sys.modules`."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import importlib, json, pkgutil, sys
import ros
ros.Hub  # the lazy SDK entry point
import ros.client
for module in pkgutil.iter_modules(ros.client.__path__, "ros.client."):
    importlib.import_module(module.name)
print(json.dumps(sorted(sys.modules)))
"""


def test_the_sdk_loads_neither_the_etcd_client_nor_the_embedded_launcher() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert "ros.client.hub" in loaded  # the probe did import the SDK
    assert not {m for m in loaded if m == "etcd3" or m.startswith("etcd3.")}
    assert "consistency.embedded" not in loaded
    assert "consistency.etcd" not in loaded
