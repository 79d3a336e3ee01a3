"""`tensorhub bench gpu` itself, on this machine without a GPU: it refuses with the reason,
and its `--device cpu` smoke run goes through every step (holder process, staged fetch,
checksums, publish) and withholds every ratio (they would say nothing about a GPU). The GPU
figures come only from a run on a device (scripts/gpu-check.sh)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import gpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_device_it_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu.main(["--size-mb", "8"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_the_cpu_smoke_run_covers_every_step_and_withholds_its_ratios(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    assert gpu.main(["--device", "cpu", "--size-mb", "8", "--repeat", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    names = {f["name"] for f in report["figures"]}
    assert {"GPU checksum rate / device copy rate",
            "TCP staging / min(pinned copy, loopback TCP)",
            "publish checksums: host xxh3 / GPU wsum64"} <= names  # fmt: skip
    assert report["ok"] is False  # a CPU run is no GPU figure
    assert "smoke run" in report["note"]
    assert report["details"]["cuda_ipc"] == "needs a GPU (--device cpu): no figure"
