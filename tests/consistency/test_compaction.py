"""Bounded etcd history: NOSPACE is `StorageFull` and recovers by itself, compaction never
costs a watch an event, one compactor leads, and the database stays flat under writes.

Each test that fills or measures etcd starts its own small member (sizes are per member);
the watch test reaches etcd through a TCP relay it can cut, so the watch really is
disconnected while the compactor compacts past it.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from prometheus_client import REGISTRY

from consistency import Etcd, EtcdCluster, Keys, KeyWatch, Session
from consistency.compactor import Compactor
from consistency.watch import RawEvent, Resync
from ros import errors as ros_errors
from ros.metrics import CompactorMetrics
from tensorhub.errors import StorageFull
from tests.waiting import wait_until

QUOTA = 2 << 20  # etcd's NOSPACE comes after about 90 puts of 60 KB


@pytest.fixture
def binary(etcd_cluster: EtcdCluster) -> str:
    """The etcd binary of the session's member (so `test_etcd35` reruns these on 3.5)."""
    return etcd_cluster.binary


@pytest.fixture
def small_etcd(binary: str) -> Iterator[Etcd]:
    """A fresh one-member etcd with a 2 MiB quota, and a client on it."""
    extra = [f"--quota-backend-bytes={QUOTA}"]
    with (
        EtcdCluster(size=1, extra_args=extra, binary=binary) as cluster,
        Etcd(cluster.endpoints) as client,
    ):
        yield client


# -- (a) NOSPACE --------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_nospace_is_storage_full_and_the_compactor_recovers(small_etcd: Etcd) -> None:
    etcd, keys = small_etcd, Keys("/test/full")
    value = b"x" * 60_000
    with pytest.raises(StorageFull, match="space"):  # noqa: PT012  (the put that fills it)
        for i in range(1000):  # overwrites of 4 keys: all but the live values are history
            etcd.put(f"{keys.prefix}/k{i % 4}", value)
    with pytest.raises(StorageFull):
        etcd.put(f"{keys.prefix}/small", "x")
    with pytest.raises(StorageFull):
        etcd.lease_grant(5)  # no lease under NOSPACE: the compactor cannot campaign now
    assert [a.kind for a in etcd.alarms()] == ["NOSPACE"]

    flags: list[bool] = []
    with Compactor(
        etcd,
        keys,
        interval=1.0,
        poll=0.1,
        on_storage_full=flags.append,
        on_tick=CompactorMetrics(),
    ) as c:
        wait_until(
            "storage no longer full", lambda: not c.status().storage_full and flags[-1:] == [False]
        )
        status = c.status()
    assert flags == [True, False]
    assert status.compactions >= 1
    assert status.defrags >= 1
    assert status.disarms >= 1
    assert status.db_size_in_use is not None
    assert status.db_size < QUOTA
    assert etcd.alarms() == []
    etcd.put(f"{keys.prefix}/small", "x")  # writes are accepted again, no operator involved
    assert REGISTRY.get_sample_value("tensorhub_etcd_storage_full") == 0
    assert (REGISTRY.get_sample_value("tensorhub_etcd_defrags_total") or 0) >= 1


def test_storage_full_round_trips_through_the_hub_error_table() -> None:
    assert ros_errors._CLASSES["StorageFull"] is StorageFull
    assert ros_errors.status_of(StorageFull("x")).name == "RESOURCE_EXHAUSTED"


# -- (b) compaction racing a resuming watch -----------------------------------------------


class Relay:
    """A TCP relay to one etcd member that can be cut: `cut()` drops every connection and
    holds new ones unanswered until `resume()` (a real network partition, no mock)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        self._open.wait()
        try:
            upstream = socket.create_connection(self._target, timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            self._sockets += [client, upstream]
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self._open.clear()
        with self._lock:
            cut, self._sockets = self._sockets, []
        for s in cut:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def resume(self) -> None:
        self._open.set()

    def close(self) -> None:
        self.cut()
        self._listener.close()
        self.resume()


@pytest.mark.timeout(40)
def test_compaction_past_a_disconnected_watch_loses_and_repeats_nothing(
    etcd_cluster: EtcdCluster, etcd: Etcd, keys: Keys
) -> None:
    prefix = f"{keys.prefix}/w/"
    _, start = etcd.get(prefix)
    written: list[tuple[int, str, int]] = []  # (revision, key, seq) of every put
    stop = threading.Event()

    def writer() -> None:
        seq = 0
        while not stop.is_set():
            key = f"{prefix}k{seq % 5}"
            written.append((etcd.put(key, str(seq)), key, seq))
            seq += 1
            time.sleep(0.002)

    relay = Relay(etcd_cluster.endpoints[0])
    seen: list[RawEvent | Resync] = []
    view: dict[str, int] = {}
    try:
        with (
            Etcd([relay.endpoint], timeout=5.0) as watch_etcd,
            KeyWatch(watch_etcd, prefix, prefix=True, start_revision=start + 1) as watch,
            Compactor(etcd, keys, interval=0.3, poll=0.05) as compactor,
        ):

            def drain(until: Callable[[], bool], timeout: float = 10.0) -> None:
                deadline = time.monotonic() + timeout
                while not until():
                    assert time.monotonic() < deadline, "the watch fell behind for good"
                    item = watch.get(timeout=0.2)
                    if item is None:
                        continue
                    seen.append(item)
                    if isinstance(item, Resync):
                        view.clear()
                        view.update({kv.key.decode(): int(kv.value) for kv in item.kvs})
                    elif item.deleted:
                        view.pop(item.kv.key.decode(), None)
                    else:
                        view[item.kv.key.decode()] = int(item.kv.value)

            thread = threading.Thread(target=writer, daemon=True)
            thread.start()
            for _ in range(2):  # two partitions, each compacted past
                drain(lambda: len(written) > 20 and watch.next_revision > written[-1][0])
                relay.cut()
                watch.force_reconnect()

                def compacted_past(behind: int = watch.next_revision) -> bool:
                    return compactor.status().compacted_revision > behind

                wait_until("compacted past the cut watch", compacted_past)
                relay.resume()
            stop.set()
            thread.join(timeout=5)
            final = etcd.range(prefix, prefix=True)
            drain(lambda: watch.next_revision > final.revision)
            resyncs = [item.revision for item in seen if isinstance(item, Resync)]
    finally:
        stop.set()
        relay.close()

    assert len(resyncs) >= 2, "the watch was never compacted past (the race did not happen)"
    assert view == {kv.key.decode(): int(kv.value) for kv in final.kvs}
    # After each re-list (and from the start), the events are the writes that followed it,
    # in order, none skipped or repeated, up to the cut; the next re-list's state is exactly
    # the writes up to its revision; after the last one, every write arrives.
    revisions = [item.revision for item in seen]
    assert revisions == sorted(revisions)
    assert len(set(revisions)) == len(revisions)
    bounds = [start, *resyncs, final.revision]
    events = [item for item in seen if isinstance(item, RawEvent)]
    for n, (low, high) in enumerate(itertools.pairwise(bounds)):
        got = [
            (e.revision, e.kv.key.decode(), int(e.kv.value))
            for e in events
            if low < e.revision <= high
        ]
        want = [w for w in written if low < w[0] <= high]
        last = n == len(bounds) - 2
        assert got == (want if last else want[: len(got)]), f"events wrong in ({low}, {high}]"
    for resync in (item for item in seen if isinstance(item, Resync)):
        state: dict[str, int] = {}
        for revision, key, seq in written:
            if revision <= resync.revision:
                state[key] = seq
        assert {kv.key.decode(): int(kv.value) for kv in resync.kvs} == state


# -- (c) one leader -----------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_one_compactor_leads_and_another_takes_over(etcd: Etcd, keys: Keys) -> None:
    # TTLs of 3 s, not 1: a 1 s session on 2 loaded cores (load average 5) lost its lease
    # before the leader's first compaction, and the test waited for one that never came
    replica = Session(etcd, ttl=3)
    first = Compactor(etcd, keys, interval=0.2, poll=0.05, session=replica, name="a").start()
    second = Compactor(etcd, keys, interval=0.2, poll=0.05, ttl=3, name="b")
    third = Compactor(etcd, keys, interval=0.2, poll=0.05, ttl=3, name="c")
    try:
        wait_until("a leads", lambda: first.status().leader)
        second.start()
        third.start()
        time.sleep(0.5)
        assert [c.status().leader for c in (first, second, third)] == [True, False, False]
        wait_until("the leader compacts", lambda: first.status().compactions >= 1)
        assert second.status().compactions == third.status().compactions == 0

        replica.orphan()  # a crashed replica: its lease runs out, its role key goes with it
        wait_until("a stops leading", lambda: not first.status().leader, timeout=10)
        wait_until("b or c takes over", lambda: second.status().leader or third.status().leader)
        leader, other = (second, third) if second.status().leader else (third, second)
        leader.stop()  # a clean stop gives the role up at once
        wait_until("the last one takes over", lambda: other.status().leader, timeout=5)
        assert not first.status().leader
        kv, _ = etcd.get(keys.hub_compactor())
        assert kv is not None
        assert kv.value.decode() == other.name
    finally:
        for c in (first, second, third):
            c.stop()
        replica.close()


def test_interval_zero_turns_the_compactor_off(etcd: Etcd, keys: Keys) -> None:
    with Compactor(etcd, keys, interval=0) as c:
        time.sleep(0.1)
        assert not c.status().enabled
        assert not c.status().leader
    assert etcd.get(keys.hub_compactor())[0] is None


# -- (d) bounded history ------------------------------------------------------------------


@pytest.mark.timeout(40)
def test_history_stays_bounded_under_writes(binary: str) -> None:
    quota = 8 << 20
    extra = [f"--quota-backend-bytes={quota}"]
    keys, value = Keys("/test/flat"), b"y" * 4_000
    with (
        EtcdCluster(size=1, extra_args=extra, binary=binary) as cluster,
        Etcd(cluster.endpoints) as etcd,
        Compactor(
            etcd, keys, interval=0.2, poll=0.05, defrag_free_bytes=1 << 20, defrag_free_ratio=0.25
        ) as c,
    ):
        in_use: list[int] = []
        for i in range(3_000):  # 12 MB of history on an 8 MiB quota: only compaction allows it
            etcd.put(f"{keys.prefix}/k{i % 8}", value)
            time.sleep(0.0005)
            if i % 500 == 499:
                in_use.append(etcd.member_status(cluster.endpoints[0]).db_size_in_use or 0)
        status = c.status()
    assert status.compactions >= 3
    assert status.db_size < 4 << 20  # bbolt reuses the pages compaction frees
    assert max(in_use) < 4 << 20, in_use  # flat: a few intervals of writes, not all of them
