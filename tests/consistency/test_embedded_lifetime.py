"""An embedded etcd member lives as long as the process that started its cluster, not as
long as the thread that asked for it (`consistency/spawner.py`): real etcd processes.

That the members end with a process killed outright is tested where that matters, on
`tensorhub serve` (`tests/ros/test_serve_flags.py`)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from consistency import EtcdCluster
from consistency.spawner import parent_death_signal_available
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(
    not parent_death_signal_available(),
    reason="needs Linux and util-linux 2.33+ (setpriv --pdeathsig), which this machine lacks",
)


@pytest.mark.timeout(120)
def test_a_member_restarted_from_a_thread_that_ends_outlives_that_thread() -> None:
    """A chaos thread calls `restart` and ends: the kernel sends a child's parent-death
    signal when the thread that forked it ends, so the member must not be forked there."""
    with EtcdCluster(size=1) as cluster:
        cluster.kill(0)
        restarter = threading.Thread(target=cluster.restart, args=(0,), name="restarter")
        restarter.start()
        restarter.join(60)
        assert not restarter.is_alive()
        # join returns before the OS thread is gone; its exit is what would send the signal
        wait_until(
            "the restarting thread has exited",
            lambda: not Path(f"/proc/self/task/{restarter.native_id}").exists(),
            10,
        )
        with cluster.client() as etcd:  # a round trip after the thread's exit
            etcd.put("/lifetime/probe", b"1")
            kv, _ = etcd.get("/lifetime/probe")
            assert kv is not None
            assert kv.value == b"1"
        member = cluster.members[0]
        assert member.alive
        assert member.process is not None
        # the Popen is etcd itself (the wrappers exec it), so kill() and poll() reach it
        assert Path(f"/proc/{member.process.pid}/comm").read_text().strip() == "etcd"
