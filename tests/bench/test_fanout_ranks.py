"""`tensorhub bench fanout`'s trainer of several ranks (`bench.fanout_ranks`): real rank
processes on an emulated host, each with its own SDK client, in one gloo group, publishing
one shard each per step through the group path and through one call per rank, against the
cluster's real hub and etcd. Needs root (netns), skipped otherwise."""

from __future__ import annotations

import os

import pytest

from bench import fanout_ranks
from bench.common import Options
from bench.emu.cluster import Cluster


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts need root (netns, tc)")
def test_the_trainer_stall_is_measured_per_step_in_both_modes() -> None:
    """Every step of each mode is timed (a version that is not visible once every rank
    returned fails the run), and the figures name the ranks and the shard size."""
    opts = Options(size_mb=2)
    with Cluster({1: 1}, opts.rate_mbit) as cluster:
        out = fanout_ranks.measure(cluster, opts, ranks=2, steps=2)
    assert out["ranks"] == 2
    assert out["shard_bytes"] == opts.nbytes // 2
    for mode in fanout_ranks.MODES:
        assert len(out["stall_s"][mode]) == 2
        assert all(s > 0 for s in out["stall_s"][mode]), out
        assert out["median_s"][mode] > 0
