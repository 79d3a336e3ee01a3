"""Shared fixtures: one real etcd per test session, and a fresh key prefix per test.

No mocked etcd anywhere: every test talks to a real etcd member on loopback (kazoo's harness
style: each test gets its own namespace, and helpers to kill or expire things).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest

from consistency import Etcd, EtcdCluster, HolderRegistry, Keys, VersionRegistry
from tensorhub.fork_server import fork_context
from tests.gloo_ranks import PRELOAD

# One fork server serves the chaos workers and the trainer ranks of a test process, and it
# imports only what was named when it started: name both before either starts it.
fork_context("chaos.roles", *PRELOAD)

_counter = itertools.count()


@pytest.fixture(scope="session")
def etcd_cluster() -> Iterator[EtcdCluster]:
    """One embedded etcd member for the whole test session."""
    with EtcdCluster(size=1) as cluster:
        yield cluster


@pytest.fixture
def etcd(etcd_cluster: EtcdCluster) -> Iterator[Etcd]:
    with Etcd(etcd_cluster.endpoints, timeout=5.0) as client:
        yield client


@pytest.fixture
def keys() -> Keys:
    """A key prefix no other test uses."""
    return Keys(f"/test/{os.getpid()}-{next(_counter)}")


@pytest.fixture
def versions(etcd: Etcd, keys: Keys) -> VersionRegistry:
    return VersionRegistry(etcd, keys, retain=2)


@pytest.fixture
def holders(versions: VersionRegistry) -> HolderRegistry:
    return HolderRegistry(versions)
