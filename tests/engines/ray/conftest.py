"""A real two-node Ray cluster on loopback, and the hub fixtures of tests/ros.

The head node is on 127.0.0.3 and the second node on 127.0.0.2 (Ray ignores 127.0.0.1 for
a head node and picks the machine's address instead), so every byte between the actors, and
to the hub on 127.0.0.1, stays on loopback. Small on purpose: one CPU per node, a 100 MB
object store, no dashboard; Ray's usage reporting is off.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.ros.conftest import connect, hub_server, make_tenant  # noqa: F401

HEAD_IP = "127.0.0.3"
WORKER_IP = "127.0.0.2"
NODE_ARGS: dict[str, Any] = {
    "num_cpus": 1,
    "object_store_memory": 100 * 1024 * 1024,
    "include_dashboard": False,
}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """The cluster's address (the head's GCS), for `--ray-address`."""
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")  # no reporting off this machine
        cluster = Cluster(
            initialize_head=True,
            connect=False,
            head_node_args={**NODE_ARGS, "node_ip_address": HEAD_IP},
        )
        try:
            cluster.add_node(**NODE_ARGS, node_ip_address=WORKER_IP)
            cluster.wait_for_nodes(timeout=60)
            yield str(cluster.address)
        finally:
            cluster.shutdown()  # type: ignore[no-untyped-call]


def example_env() -> dict[str, str]:
    """The environment the example runs in: this one, without Ray's usage reporting."""
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
