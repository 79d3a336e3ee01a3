"""Group commit: the writes that wait at the same moment for one key go in one transaction.

When a thousand ranks publish their shards of one version at once, or a thousand clients open
their sessions at once, every one of those writes touches a key they share (the version's
shard counter, the tenant's session fence). Committed one by one they either queue or fail
each other's compares, O(N) transactions for N writes and O(N^2) work. Like a database's
group commit, a `GroupCommit` keeps one transaction in flight per key: a write that arrives
while one is in flight waits, and the next transaction takes every write waiting by then
(as many as `take` lets into one etcd transaction). A batch that is not full may first wait
a few milliseconds for more writes of its key (`linger`, like a database's commit delay),
when more are expected: the shards of a version still to come. A lone write commits at once,
as before.

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
    busy: bool = False
    lingering: asyncio.TimerHandle | None = None  # a short wait for more, before a batch


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
        linger: Callable[[list[E], int], float] | None = None,
    ) -> None:
        """`linger(waiting, submitted)`: how long a batch that is not full yet should wait
        for more writes of its key (0: go now), given the entries waiting and how many were
        submitted for the key on this replica so far. Under a burst, a short wait fills
        each transaction (fewer revisions, less etcd and hub work); a write nobody else will
        join should not wait."""
        self._executor = executor
        self._linger = linger
        self._submitted: SizedLru[K, int] = SizedLru(MAX_KEYS_COUNTED, lambda _: 1)
        self._sizes = HUB_BATCH_SIZE.labels(kind or "other")
        self._commit = commit
        self._take = take
        self._abandon = abandon
        self._queues: dict[K, _Queue[E, R]] = {}
        self.batches = 0  # transactions started (for tests and metrics)
        self.largest = 0  # the most entries one batch took

    def waiting(self, key: K) -> int:
        """Entries of `key` waiting for a batch now (the in-flight one not counted)."""
        queue = self._queues.get(key)
        return len(queue.waiting) if queue else 0

    async def submit(self, key: K, entry: E) -> R:
        """Wait for `entry`'s batch to commit; its outcome (raised if an exception)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        queue = self._queues.setdefault(key, _Queue())
        queue.waiting.append(_Waiting(entry, future))
        self._submitted.put(key, (self._submitted.get(key) or 0) + 1)
        if not queue.busy:
            self._next(key, queue, loop)
        elif queue.lingering is not None and not self._wait_for(key, queue):
            queue.lingering.cancel()  # full now: no need to wait for the rest
            self._next(key, queue, loop, lingered=True)
        return await future

    def _wait_for(self, key: K, queue: _Queue[E, R]) -> float:
        if self._linger is None:
            return 0.0
        live = [w.entry for w in queue.waiting if not w.future.done()]
        return self._linger(live, self._submitted.get(key) or 0) if live else 0.0

    def _next(
        self,
        key: K,
        queue: _Queue[E, R],
        loop: asyncio.AbstractEventLoop,
        *,
        lingered: bool = False,
    ) -> None:
        """Start the next batch of `key` (after a short wait for more, if `linger` asks for
        one and it has not waited yet), or retire its queue if nothing live is waiting."""
        queue.lingering = None
        if not lingered:
            delay = self._wait_for(key, queue)
            if delay > 0:
                queue.busy = True
                queue.lingering = loop.call_later(
                    delay, lambda: self._next(key, queue, loop, lingered=True)
                )
                return
        gone = [w.entry for w in queue.waiting if w.future.done()]
        live = [w for w in queue.waiting if not w.future.done()]
        if gone and self._abandon is not None:
            loop.run_in_executor(self._executor, self._abandon, key, gone)
        entries = [w.entry for w in live]
        batch = self._take(entries)
        left = {id(e) for e in entries}
        queue.waiting = [w for w in live if id(w.entry) in left]
        taken = [w for w in live if id(w.entry) not in left]
        if not taken:
            queue.busy = False
            if not queue.waiting:
                self._queues.pop(key, None)
            return
        queue.busy = True
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
        self._next(key, queue, loop)
