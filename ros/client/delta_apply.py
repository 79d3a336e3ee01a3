"""`Applier`: applies a chain of deltas to the chunks of a destination on threads of its
own, each chunk once its encoded bytes are in (`ros.client.delta_chunks.apply_many`
applies the chunks a thread takes from the queue together, each with its checks).

Why threads of its own: the thread that receives the companion only queues what has
landed, so the companion's transfer and its COMPLETE call are not held up behind the
applying; and where cores are many, chunks apply side by side (zstd, numpy's scatter of
the changed words and the result's xxh3 run without the GIL; `THREADS`). Chunks are
independent: each writes only its own bytes of the destination, and is marked present by
itself once its result checks.

Nothing writes the destination after `close()` returns: the chunks still queued are
dropped (the fetch's rounds read them whole) and the ones being applied are waited for.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ros.client.delta_chunks import BaseCheck, Encoded, Link, apply_many, landed
from ros.client.orchestrator import Landed
from transport.store import HeldVersion


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# Chunks applied at once: one per 4 cores, at most 4. Each thread needs the GIL between
# its calls that run without it, so where other processes hold the cores, a second thread
# waits on the first (on 2 busy cores, two threads gave steps of 0.7-1.8 s against
# 0.1-0.2 s for one in `bench delta`); one thread still takes the applying off the thread
# that receives the companion.
THREADS = max(1, min(4, _cores() // 4))
# chunks one thread applies together: their changed words are decoded at once
# (`delta_chunks.apply_many`), at most this many, so that `close` and a deadline wait for
# no more than a few milliseconds of work
BATCH = 32
# the most `close` waits for the chunks being applied: each is one chunk's CPU work
# (milliseconds), so only a stopped process takes this long
DRAIN_S = 30.0


class Applier:
    """Applies the chain `links` to the chunks `todo` of `dest`, each once its encoded bytes
    are in: as the one link's companion lands (`watch`), and the rest once every link's
    companion is in (`finish`). Counts the chunks made (`done`) and those that failed a
    check (`failed`). Thread-safe; `close()` it (a context manager)."""

    def __init__(
        self,
        links: list[Link],
        dest: HeldVersion,
        todo: list[int],
        kind: str,
        base: BaseCheck,
        threads: int = THREADS,
    ) -> None:
        self._links, self._dest, self._todo, self._kind, self._base = links, dest, todo, kind, base
        self._next = 0  # todo[:_next] are queued (or applied, or failed)
        self.done = 0
        self.failed = 0
        self._queue: deque[tuple[int, list[Encoded]]] = deque()
        self._threads = max(1, threads)
        self._running = 0  # drain tasks running now
        self._stopped = False
        self._cond = threading.Condition()
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="delta-apply")

    def __enter__(self) -> Applier:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def queued(self) -> int:
        """Chunks handed to the threads so far (applied, failed, or waiting)."""
        with self._cond:
            return self._next

    def watch(self, companion: HeldVersion) -> Landed:
        """What to tell as each chunk of `companion` (the one link's) lands: the chunks whose
        encoded bytes are all in are queued (in order), and applied on the threads."""
        encoded = Encoded(self._links[0].manifest.delta, companion.tensors)

        def told(_chunk: int) -> None:
            self._enqueue([encoded], lambda i: landed(companion, encoded.span(i)))

        return told

    def finish(self, companions: Sequence[Mapping[str, torch.Tensor]], end: float) -> None:
        """Every link's companion is in: apply what is left, and wait for every queued chunk
        until `end` (a `time.monotonic()` value; what is not applied by then is dropped).
        With `end` already passed nothing more is started: the rounds read those chunks."""
        if time.monotonic() >= end:
            with self._cond:
                self._stopped = True
                self._queue.clear()
            return
        pairs = zip(self._links, companions, strict=True)
        self._enqueue([Encoded(link.manifest.delta, tensors) for link, tensors in pairs], None)
        self.wait(end)

    def wait(self, end: float) -> None:
        """Wait until every queued chunk is applied, or until `end`, when the rest is dropped
        (`close` waits for those being applied)."""
        with self._cond:
            while (self._queue or self._running) and not self._stopped:
                left = end - time.monotonic()
                if left <= 0:
                    self._stopped = True
                    self._queue.clear()
                    break
                self._cond.wait(min(left, 1.0))

    def close(self) -> None:
        """Drop the chunks not started and wait (at most `DRAIN_S`) for those being applied:
        afterwards nothing writes the destination."""
        with self._cond:
            self._stopped = True
            self._queue.clear()
            end = time.monotonic() + DRAIN_S
            while self._running and time.monotonic() < end:
                self._cond.wait(end - time.monotonic())
        self._pool.shutdown(wait=False)  # its threads are idle: they go

    def _enqueue(self, blobs: list[Encoded], ready: Callable[[int], bool] | None) -> None:
        """Queue the next chunks of `todo`, in order, while `ready` says their encoded bytes
        are in (None: all are), and start a drain task for each idle thread."""
        with self._cond:
            if self._stopped:
                return
            while self._next < len(self._todo):
                index = self._todo[self._next]
                if ready is not None and not ready(index):
                    break
                self._next += 1
                self._queue.append((index, blobs))
            while self._running < min(self._threads, len(self._queue)):
                self._pool.submit(self._drain)
                self._running += 1

    def _take(self) -> tuple[list[int], list[Encoded]]:
        """The next chunks of the queue to apply together (held `_cond`, the queue not
        empty): those of the same links' bytes, at most `BATCH`, and no more than this
        thread's share of the queue, so that every thread has some."""
        blobs = self._queue[0][1]
        most = min(BATCH, -(-len(self._queue) // self._threads))
        batch: list[int] = []
        while self._queue and self._queue[0][1] is blobs and len(batch) < most:
            batch.append(self._queue.popleft()[0])
        return batch, blobs

    def _drain(self) -> None:
        """Apply queued chunks until none is left, or the applier is stopped."""
        try:
            while True:
                with self._cond:
                    if not self._queue or self._stopped:
                        return
                    batch, blobs = self._take()
                made = apply_many(self._links, blobs, self._dest, batch, self._kind, self._base)
                with self._cond:
                    self.done += made
                    self.failed += len(batch) - made
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()
