"""The revision floor never lets a client accept an older answer."""

from __future__ import annotations

import threading

import pytest

from consistency import Etcd, RevisionFloor
from tensorhub.errors import StaleRead


def test_floor_rises_and_rejects_older() -> None:
    floor = RevisionFloor()
    assert floor.accept(5) == 5
    floor.accept(5)
    floor.accept(9)
    with pytest.raises(StaleRead, match="older than revision 9"):
        floor.accept(8)
    floor.observe(3)
    assert floor.value == 9


def test_floor_with_real_reads_and_an_old_revision(etcd: Etcd, keys) -> None:  # type: ignore[no-untyped-def]
    """A read served at an old revision (as a lagging replica would) is refused."""
    floor = RevisionFloor()
    old = etcd.put(keys.prefix + "/k", "1")
    new = etcd.put(keys.prefix + "/k", "2")
    floor.accept(etcd.range(keys.prefix + "/k").revision)
    stale = etcd.range(keys.prefix + "/k", revision=old)
    assert stale.kvs[0].value == b"1"
    assert new > old
    with pytest.raises(StaleRead):
        floor.accept(old)


def test_floor_is_thread_safe() -> None:
    floor = RevisionFloor()

    def bump(base: int) -> None:
        for i in range(1000):
            floor.observe(base + i)

    threads = [threading.Thread(target=bump, args=(i * 1000,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert floor.value == 3999
