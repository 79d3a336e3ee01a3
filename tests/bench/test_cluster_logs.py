"""The emulated-host cluster leaves no log directory behind (it left a /tmp/tensorhub-bench-*
directory per run). Needs root (netns), skipped otherwise."""

from __future__ import annotations

import os

import pytest

from bench.emu.cluster import Cluster


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts need root (netns, tc)")
def test_a_cluster_run_removes_its_log_directory() -> None:
    with Cluster({1: 1}, 100.0) as cluster:
        logs = cluster.logs
        assert any(logs.glob("hub-*.log"))  # the hub replica and the participant log there
    assert not logs.exists()
