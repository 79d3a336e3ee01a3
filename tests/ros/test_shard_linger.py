"""No linger where nothing is coming (issue 35, item 4): a group commit's batch waits for more
writes only when writes gathered while a transaction ran, and never when it carries the
version's last shard.

The first tests drive `ros.hub.group_commit.GroupCommit` itself (a real thread pool, a commit
function the test holds at its door); the rest publish shards through a real hub (gRPC on
loopback, real etcd), holding a transaction with a failpoint, never a timer. Whether a batch
waited is read from `GroupCommit.lingered`, not from a clock.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from ros.hub.group_commit import GroupCommit
from ros.hub.server import HubServer
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tests.ros.failpoints import HeldTxn
from tests.ros.test_burst import (
    error_name,
    gather,
    metadata,
    run_burst,
    shard_request,
    tenant,
    transactions,
    wait_until,
)

FOREVER = 600.0  # a linger cap no test waits out: a batch that lingers to it fails the test
QUIET = 1.5  # how long a held transaction runs before the test adds writes (its lull)


class Door:
    """A commit function for `GroupCommit` that records each batch and, while `held`, waits
    (at most 30 s) at the door of each transaction until `release()`."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.entered = threading.Semaphore(0)
        self._open = threading.Event()
        self._open.set()

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def commit(self, key: str, entries: list[str]) -> list[str]:
        self.batches.append(list(entries))
        self.entered.release()
        assert self._open.wait(30)
        return [f"done {e}" for e in entries]

    def wait_entered(self, seconds: float = 20) -> None:
        assert self.entered.acquire(timeout=seconds), "no transaction started"


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    executor = ThreadPoolExecutor(4)
    yield executor
    executor.shutdown(wait=False, cancel_futures=True)


def _group(
    pool: ThreadPoolExecutor, door: Door, linger: Callable[[str, list[str], int], float]
) -> GroupCommit[str, str, str]:
    def take(entries: list[str]) -> list[str]:
        batch = list(entries)
        entries.clear()
        return batch

    return GroupCommit(pool, door.commit, take, kind="test", linger=linger)


def test_a_batch_is_taken_from_its_window_of_the_oldest_and_the_rest_keep_their_order(
    pool: ThreadPoolExecutor,
) -> None:
    """With `window`, `take` is shown only the oldest live entries (a burst queues thousands,
    a batch holds a few dozen): batches still go oldest first, each write exactly once, in
    the order written; an entry whose caller left is abandoned, the window's or not."""
    door = Door()
    shown: list[int] = []
    abandoned: list[str] = []

    def take(entries: list[str]) -> list[str]:
        shown.append(len(entries))
        batch = entries[:2]  # a batch holds two
        del entries[:2]
        return batch

    group: GroupCommit[str, str, str] = GroupCommit(
        pool, door.commit, take, lambda key, gone: abandoned.extend(gone), kind="test",
        window=3,
    )  # fmt: skip

    async def main() -> list[str]:
        door.hold()
        first = asyncio.ensure_future(group.submit("k", "w0"))
        await asyncio.to_thread(door.wait_entered)
        waiting = group.submit_all("k", [f"w{i}" for i in range(1, 10)])
        waiting[1].cancel()  # w2 (in the first window) leaves
        waiting[7].cancel()  # w8 (beyond it) leaves
        door.release()
        done = await asyncio.wait_for(asyncio.gather(first, *waiting, return_exceptions=True), 20)
        return [d for d in done if isinstance(d, str)]

    assert asyncio.run(main()) == [f"done w{i}" for i in range(10) if i not in (2, 8)]
    assert [e for b in door.batches for e in b] == [f"w{i}" for i in range(10) if i not in (2, 8)]
    assert all(len(b) <= 2 for b in door.batches)
    assert max(shown) <= 3, shown  # never more than the window
    wait_until("both abandoned (in the pool)", lambda: len(abandoned) == 2)
    assert sorted(abandoned) == ["w2", "w8"]


def test_writes_one_after_another_never_linger(pool: ThreadPoolExecutor) -> None:
    """Each write finds nothing in flight and commits at once, although `linger` asks every
    batch to wait for more (as a version's early shards do)."""
    door = Door()
    group = _group(pool, door, lambda key, waiting, submitted: FOREVER)

    async def main() -> list[str]:
        return [await asyncio.wait_for(group.submit("k", f"w{i}"), 20) for i in range(5)]

    assert asyncio.run(main()) == [f"done w{i}" for i in range(5)]
    assert door.batches == [[f"w{i}"] for i in range(5)]
    assert group.lingered == 0


def test_one_write_gathered_behind_a_transaction_goes_next_without_lingering(
    pool: ThreadPoolExecutor,
) -> None:
    door = Door()
    group = _group(pool, door, lambda key, waiting, submitted: FOREVER)

    async def main() -> list[str]:
        door.hold()
        first = asyncio.ensure_future(group.submit("k", "a"))
        await asyncio.to_thread(door.wait_entered)
        second = asyncio.ensure_future(group.submit("k", "b"))
        await asyncio.sleep(0)
        door.release()
        return list(await asyncio.wait_for(asyncio.gather(first, second), 20))

    assert asyncio.run(main()) == ["done a", "done b"]
    assert door.batches == [["a"], ["b"]]
    assert group.lingered == 0


def test_a_gathered_batch_lingers_until_linger_says_the_last_write_is_here(
    pool: ThreadPoolExecutor,
) -> None:
    """Two writes gathered while a transaction ran: the batch lingers (more are expected);
    the write that `linger` says completes the key joins it, and the batch goes at once."""
    door = Door()
    group = _group(
        pool, door, lambda key, waiting, submitted: 0.0 if "last" in waiting else FOREVER
    )

    async def checked() -> list[str]:
        door.hold()
        first = asyncio.ensure_future(group.submit("k", "a"))
        await asyncio.to_thread(door.wait_entered)
        await asyncio.sleep(QUIET)  # the transaction runs this long: the lull is as long
        gathered = [asyncio.ensure_future(group.submit("k", w)) for w in ("b", "c")]
        await asyncio.sleep(0)
        door.release()
        await asyncio.wait_for(first, 20)
        await asyncio.to_thread(wait_until, "the batch lingers", lambda: group.lingered == 1)
        assert door.batches == [["a"]]
        last = asyncio.ensure_future(group.submit("k", "last"))
        return list(await asyncio.wait_for(asyncio.gather(*gathered, last), 20))

    assert asyncio.run(checked()) == ["done b", "done c", "done last"]
    assert door.batches == [["a"], ["b", "c", "last"]]


def test_a_lull_as_long_as_the_last_transaction_ends_a_linger(pool: ThreadPoolExecutor) -> None:
    """The batch lingers with a cap no test waits out, and still goes once no write has
    arrived for as long as the transaction before it took."""
    door = Door()
    group = _group(pool, door, lambda key, waiting, submitted: FOREVER)

    async def main() -> list[str]:
        door.hold()
        first = asyncio.ensure_future(group.submit("k", "a"))
        await asyncio.to_thread(door.wait_entered)
        gathered = [asyncio.ensure_future(group.submit("k", w)) for w in ("b", "c")]
        await asyncio.sleep(0)
        door.release()
        return list(await asyncio.wait_for(asyncio.gather(first, *gathered), 20))

    assert asyncio.run(main()) == ["done a", "done b", "done c"]
    assert door.batches == [["a"], ["b", "c"]]
    assert group.lingered == 1


# -- through a hub -----------------------------------------------------------------------------


def _stub(address: str) -> tuple[grpc.Channel, Any]:
    channel = grpc.insecure_channel(address)
    return channel, hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]


def test_shards_published_one_after_another_commit_each_at_once(hub_server: HubServer) -> None:
    """A pipeline-parallel trainer's stages arriving apart: every shard commits in its own
    transaction as it arrives, none lingers, and the last makes the version visible."""
    count = 6
    token = tenant(hub_server, "seq")
    group = hub_server.servicer.hub.shard_batches.group
    md = metadata(token)
    channel, stub = _stub(hub_server.address)
    try:
        session = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60), metadata=md).session_id
        replies = [
            stub.Publish(shard_request(i, count, session, "seq"), metadata=md, timeout=20)
            for i in range(count)
        ]
    finally:
        channel.close()
    assert [r.visible for r in replies] == [False] * (count - 1) + [True]
    assert group.lingered == 0
    assert transactions(hub_server, hub_server.keys.shards("seq", "seq", 1)) == count


def test_the_shard_that_completes_a_version_is_never_held(
    hub_server: HubServer, held: list[HeldTxn]
) -> None:
    """Shards 1 and 2 gather behind shard 0's held transaction and linger for the rest of
    the version; shard 3, the last, joins them and the batch commits at once."""
    count = 4
    token = tenant(hub_server, "last")
    group = hub_server.servicer.hub.shard_batches.group
    failpoint = HeldTxn(hub_server.etcd, hub_server.keys.shards("last", "mp", 1))
    held.append(failpoint)
    md = metadata(token)

    async def body(stubs: list[Any]) -> list[Any]:
        stub = stubs[0]
        session = (
            await stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60), metadata=md)
        ).session_id

        def publish(i: int) -> Any:
            return stub.Publish(shard_request(i, count, session), metadata=md, timeout=30)

        first = asyncio.ensure_future(publish(0))
        await asyncio.to_thread(failpoint.reached.wait, 30)
        await asyncio.sleep(QUIET)  # shard 0's transaction runs this long: so does the lull
        gathered = asyncio.ensure_future(gather([publish(1), publish(2)]))
        await asyncio.to_thread(
            wait_until, "shards 1 and 2 wait", lambda: group.waiting(("last", "mp", 1)) == 2
        )
        failpoint.release()
        await asyncio.to_thread(wait_until, "their batch lingers", lambda: group.lingered == 1)
        last = await publish(3)
        return [await first, *(await gathered), last]

    results = run_burst([hub_server.address], token, body)
    errors = [error_name(r) for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    assert [r.visible for r in results] == [False, True, True, True]
    assert transactions(hub_server, hub_server.keys.shards("last", "mp", 1)) == 2
    assert group.lingered == 1


def test_a_replica_counts_the_shards_other_replicas_committed_before_it_lingers(
    hub_server: HubServer, etcd_cluster: Any
) -> None:
    """Shards 0 and 1 commit on replica A. On replica B shard 2 commits (held), and shards 3
    and 4 gather behind it: B has seen 3 of 5 shards, but its batch read the counter (2
    committed elsewhere), so the batch of 3 and 4 completes the version and does not wait."""
    count = 5
    token = tenant(hub_server, "apart")
    other = HubServer(etcd_cluster.endpoints, admin_token="x", keys=hub_server.keys).start()
    failpoint: HeldTxn | None = None
    md = metadata(token)
    try:
        channel, stub = _stub(hub_server.address)
        try:
            session = stub.OpenSession(
                pb.OpenSessionRequest(ttl_seconds=60), metadata=md
            ).session_id
            early = [
                stub.Publish(shard_request(i, count, session), metadata=md, timeout=20)
                for i in range(2)
            ]
        finally:
            channel.close()
        failpoint = HeldTxn(other.etcd, hub_server.keys.shards("apart", "mp", 1))
        group = other.servicer.hub.shard_batches.group

        async def body(stubs: list[Any]) -> list[Any]:
            stub = stubs[0]

            def publish(i: int) -> Any:
                return stub.Publish(shard_request(i, count, session), metadata=md, timeout=30)

            assert failpoint is not None
            first = asyncio.ensure_future(publish(2))
            await asyncio.to_thread(failpoint.reached.wait, 30)
            await asyncio.sleep(QUIET)
            gathered = asyncio.ensure_future(gather([publish(3), publish(4)]))
            await asyncio.to_thread(
                wait_until, "shards 3 and 4 wait", lambda: group.waiting(("apart", "mp", 1)) == 2
            )
            failpoint.release()
            return [await first, *(await gathered)]

        later = run_burst([other.address], token, body)
    finally:
        if failpoint is not None:
            failpoint.remove()
        other.stop(grace=0.2)
    errors = [error_name(r) for r in later if isinstance(r, BaseException)]
    assert not errors, errors
    assert [r.visible for r in [*early, *later]] == [False, False, False, True, True]
    assert group.lingered == 0
    assert transactions(hub_server, hub_server.keys.shards("apart", "mp", 1)) == 4


def test_a_lingering_batch_holds_no_other_key(pool: ThreadPoolExecutor) -> None:
    """A batch that lingers holds no thread: other keys commit meanwhile."""
    door = Door()
    group = _group(pool, door, lambda key, waiting, submitted: FOREVER if key == "slow" else 0.0)

    async def main() -> list[str]:
        door.hold()
        first = asyncio.ensure_future(group.submit("slow", "a"))
        await asyncio.to_thread(door.wait_entered)
        await asyncio.sleep(QUIET)
        gathered = [asyncio.ensure_future(group.submit("slow", w)) for w in ("b", "c")]
        await asyncio.sleep(0)
        door.release()
        await asyncio.wait_for(first, 20)
        await asyncio.to_thread(wait_until, "slow lingers", lambda: group.lingered == 1)
        other = await asyncio.wait_for(group.submit("fast", "x"), 20)
        return [other, *(await asyncio.wait_for(asyncio.gather(*gathered), 20))]

    assert asyncio.run(main()) == ["done x", "done b", "done c"]
    assert door.batches[-1] == ["b", "c"]
