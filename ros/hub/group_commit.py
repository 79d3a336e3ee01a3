"""Group commit: the writes that wait at the same moment for one key go in one transaction.

When a thousand ranks publish their shards of one version at once, or a thousand clients open
their sessions at once, every one of those writes touches a key they share (the version's
shard counter, the tenant's session fence). Committed one by one they either queue or fail
each other's compares, O(N) transactions for N writes and O(N^2) work. Like a database's
group commit, a `GroupCommit` keeps one transaction in flight per key: a write that arrives
while one is in flight waits, and the next transaction takes every write waiting by then
(as many as `take` lets into one etcd transaction). A write that finds nothing in flight
for its key commits at once: nothing tells that another is coming, so a lone write, or one of
writes that arrive one after another, never waits. Only a batch that gathered while a
transaction ran, two writes or more (so writes arrive faster than one per transaction), may
wait a little longer to fill (`linger`, like a database's commit delay) when more are
expected: the shards of a version still to come. It stops waiting when the batch is full,
when `linger` says nothing more is expected (the version's last shard is here), when no write
has arrived for as long as the transaction before it took (the burst has stopped), or at
`linger`'s cap.

Everything here runs on the replica's event loop (no locks): a waiting write is a future,
not a thread, so thousands can wait while the transactions themselves run in the worker
pool. A write whose caller has gone (its call cancelled, its deadline passed) before its
batch was taken is left out and handed to `abandon`; one already in a transaction gets that
transaction's outcome.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ros.metrics import HUB_BATCH_SIZE
from tensorhub.lru import SizedLru

K = TypeVar("K", bound=Hashable)
E = TypeVar("E")
R = TypeVar("R")

Commit = Callable[[K, list[E]], Sequence[R | BaseException]]


@dataclass
class _Waiting(Generic[E, R]):
    entry: E
    future: asyncio.Future[R]


@dataclass
class _Queue(Generic[E, R]):
    waiting: list[_Waiting[E, R]] = field(default_factory=list)
    busy: bool = False  # a transaction in flight, or a batch lingering
    lingering: asyncio.TimerHandle | None = None  # a short wait for more, before a batch
    started: float = 0.0  # loop time the transaction in flight started
    took: float = 0.0  # seconds the last transaction took: how long a lull ends a linger
    arrived: float = 0.0  # loop time of the last submission
    until: float = 0.0  # loop time a linger ends in any case (its cap)


MAX_KEYS_COUNTED = 4096  # keys whose submissions are counted (for `linger`), remembered


class GroupCommit(Generic[K, E, R]):
    """Batches per key: `commit(key, entries)` (run in `executor`) returns one outcome per
    entry, a result or an exception to raise to that entry's caller; `take(entries)` removes
    and returns the next batch from the waiting entries (oldest first); `abandon(key,
    entries)` (run in `executor`) cleans up after entries whose callers left first."""

    def __init__(
        self,
        executor: Executor,
        commit: Commit[K, E, R],
        take: Callable[[list[E]], list[E]],
        abandon: Callable[[K, list[E]], None] | None = None,
        *,
        kind: str = "",
        linger: Callable[[K, list[E], int], float] | None = None,
        window: int | None = None,
    ) -> None:
        """`linger(key, waiting, submitted)`: the most a batch that gathered while a transaction
        ran should wait for more writes of its key (0: go now), given the entries waiting
        and how many were submitted for the key on this replica so far. Under a burst, a
        short wait fills each transaction (fewer revisions, less etcd and hub work); it is
        asked again at every arrival, and a lull as long as the last transaction ends it.
        `window`: how many of the oldest live entries `take` is shown for a batch (None:
        all). A burst queues thousands; a batch that can hold at most a few dozen need not
        look past them (each batch that did made a few passes over the whole queue: about
        a tenth of a hub loop's CPU over a 4,096-shard group call)."""
        self._executor = executor
        self._linger = linger
        self._submitted: SizedLru[K, int] = SizedLru(MAX_KEYS_COUNTED, lambda _: 1)
        self._sizes = HUB_BATCH_SIZE.labels(kind or "other")
        self._commit = commit
        self._take = take
        self._abandon = abandon
        self._window = window
        self._queues: dict[K, _Queue[E, R]] = {}
        self.batches = 0  # transactions started (for tests and metrics)
        self.largest = 0  # the most entries one batch took
        self.lingered = 0  # batches that waited for more writes before they started

    def waiting(self, key: K) -> int:
        """Entries of `key` waiting for a batch now (the in-flight one not counted)."""
        queue = self._queues.get(key)
        return len(queue.waiting) if queue else 0

    async def submit(self, key: K, entry: E) -> R:
        """Wait for `entry`'s batch to commit; its outcome (raised if an exception)."""
        return await self.submit_all(key, [entry])[0]

    def submit_all(self, key: K, entries: Sequence[E]) -> list[asyncio.Future[R]]:
        """Hand in `entries` together, as one caller that has them all at once (a process
        group's shards, `ros.hub.shard_group`): they join the queue in one step, so a key
        with nothing in flight takes as many of them as fit into its next batch, instead of
        the first alone. Each entry's future gets its outcome; cancelling one leaves its
        entry out of any batch not yet taken."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[R]] = [loop.create_future() for _ in entries]
        if not futures:
            return futures
        queue = self._queues.setdefault(key, _Queue())
        queue.waiting += [_Waiting(e, f) for e, f in zip(entries, futures, strict=True)]
        queue.arrived = loop.time()
        self._submitted.put(key, (self._submitted.get(key) or 0) + len(futures))
        if not queue.busy:
            self._next(key, queue, loop)  # nothing in flight: nothing to wait for
        elif queue.lingering is not None and not self._wait_for(key, queue):
            queue.lingering.cancel()  # full now, or nothing more expected: go
            self._next(key, queue, loop)
        return futures

    def _wait_for(self, key: K, queue: _Queue[E, R]) -> float:
        if self._linger is None:
            return 0.0
        live = [w.entry for w in queue.waiting if not w.future.done()]
        return self._linger(key, live, self._submitted.get(key) or 0) if live else 0.0

    def _after_commit(self, key: K, queue: _Queue[E, R], loop: asyncio.AbstractEventLoop) -> None:
        """The next batch after a transaction: at once, unless two writes or more gathered
        while it ran and `linger` expects more (then a linger, `_lull`)."""
        queue.took = loop.time() - queue.started
        cap = self._wait_for(key, queue) if _live_at_least(queue.waiting, 2) else 0.0
        if cap <= 0:
            self._next(key, queue, loop)
            return
        queue.until = loop.time() + cap
        self.lingered += 1
        self._lull(key, queue, loop)

    def _lull(self, key: K, queue: _Queue[E, R], loop: asyncio.AbstractEventLoop) -> None:
        """Linger until no write has arrived for as long as the last transaction took, or
        until the cap; arrivals meanwhile only move the check (no timer each)."""
        queue.lingering = None
        now = loop.time()
        quiet_at = queue.arrived + queue.took
        if now >= queue.until or now >= quiet_at:
            self._next(key, queue, loop)
            return
        queue.busy = True
        queue.lingering = loop.call_at(
            min(quiet_at, queue.until), lambda: self._lull(key, queue, loop)
        )

    def _next(self, key: K, queue: _Queue[E, R], loop: asyncio.AbstractEventLoop) -> None:
        """Start the next batch of `key`, or retire its queue if nothing live is waiting."""
        queue.lingering = None
        live: list[_Waiting[E, R]] = []
        gone: list[E] = []
        window = len(queue.waiting) if self._window is None else self._window
        seen = 0  # the oldest entries looked at: the live ones up to `window`, the gone ones
        for w in queue.waiting:
            if len(live) >= window:
                break
            seen += 1
            if w.future.done():
                gone.append(w.entry)
            else:
                live.append(w)
        if gone and self._abandon is not None:
            loop.run_in_executor(self._executor, self._abandon, key, gone)
        batch = self._take([w.entry for w in live])
        chosen = {id(e) for e in batch}
        unseen = queue.waiting[seen:]
        queue.waiting = []
        taken: list[_Waiting[E, R]] = []
        for w in live:  # both in the queue's order (`take` keeps it)
            (taken if id(w.entry) in chosen else queue.waiting).append(w)
        queue.waiting += unseen  # younger than every entry looked at
        if not taken:
            queue.busy = False
            if not queue.waiting:
                self._queues.pop(key, None)
            return
        queue.busy = True
        queue.started = loop.time()
        self.batches += 1
        self.largest = max(self.largest, len(batch))
        self._sizes.observe(len(batch))
        running = loop.run_in_executor(self._executor, self._commit, key, batch)
        running.add_done_callback(lambda done: self._done(key, queue, taken, done, loop))

    def _done(
        self,
        key: K,
        queue: _Queue[E, R],
        taken: list[_Waiting[E, R]],
        done: asyncio.Future[Sequence[R | BaseException]],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """Hand each caller its outcome, then start the next batch."""
        try:
            outcomes: Sequence[R | BaseException] = done.result()
        except BaseException as exc:  # the batch as a whole failed: every caller hears why
            outcomes = [exc] * len(taken)
        for waiting, outcome in zip(taken, outcomes, strict=True):
            if waiting.future.done():
                continue  # its caller left meanwhile
            if isinstance(outcome, BaseException):
                waiting.future.set_exception(outcome)
            else:
                waiting.future.set_result(outcome)
        self._after_commit(key, queue, loop)


def _live_at_least(waiting: Sequence[_Waiting[E, R]], count: int) -> bool:
    """Whether `count` of `waiting` or more still wait (looks no further than that)."""
    for w in waiting:
        if not w.future.done():
            count -= 1
            if count <= 0:
                return True
    return count <= 0
