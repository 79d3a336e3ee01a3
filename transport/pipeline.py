"""Double-buffered staging: copies to and from host buffers overlapped with the network.

A chunk of a CUDA-resident version crosses host memory on its way to or from a socket.
With one buffer every copy waits for the socket and every send or receive waits for the
copy; with two, one buffer is on the wire while the other is being copied.

- `GatherAhead` (send side): the chunk being sent sits in one buffer while the next one is
  gathered device→host into the other; a chunk's bytes are handed out only once its own
  copy's event completed.
- `ScatterBehind` (receive side): a chunk is received into one buffer while the previous
  one's host→device copy runs from the other; a chunk is committed (its `on_done` run:
  `HeldVersion.mark_present`) only once its copy's event completed, in the order the
  copies were issued, and `flush` completes and commits every pending one.

On both sides a buffer is reused only after its last copy's event completed. The classes
know nothing about CUDA: they are written against `transport.copies.Copies`, so the same
code runs synchronously on the CPU (and is tested there) and asynchronously on a GPU.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence

import torch

from tensorhub.errors import InvalidArgument
from transport.copies import DONE, Copies, Event, Pair

Parts = Callable[[], Sequence[torch.Tensor]]
"""The device side of one chunk: its segments as 1-D uint8 tensors, in payload order
(called only when a copy is issued, so a chunk already staged costs no slicing)."""


class _Buffer:
    """One host buffer and the event of the last copy into or out of it."""

    def __init__(self, copies: Copies, size: int) -> None:
        self.host = copies.host_buffer(size)
        self.view = self.host.numpy().data.cast("B")
        self.event: Event = DONE
        self.length = 0  # bytes of the chunk it holds
        self.key: Hashable | None = None  # send side: the chunk it holds (or is gathering)
        self.tag = -1  # receive side: the chunk whose copy it is the source of
        self.on_done: Callable[[], None] | None = None  # receive side: the commit

    def pairs(self, parts: Sequence[torch.Tensor], *, into_host: bool) -> list[Pair]:
        """(dst, src) for each part against consecutive ranges of this buffer."""
        total = sum(p.numel() for p in parts)
        if total > self.host.numel():
            raise InvalidArgument(f"a chunk of {total} B does not fit {self.host.numel()} B")
        self.length = total
        out: list[Pair] = []
        pos = 0
        for p in parts:
            n = p.numel()
            host = self.host[pos : pos + n]
            out.append((host, p) if into_host else (p, host))
            pos += n
        return out


class GatherAhead:
    """Send side: device→host copies of the chunks to send, one chunk ahead.

    `take(key, parts, then)` returns chunk `key`'s bytes in host memory; `then` (the next
    chunk's key and parts) starts gathering into the other buffer before this call waits,
    so that copy runs while the caller sends this chunk. A returned view stays valid until
    the next call; `drain` waits for every copy and forgets what the buffers hold (call it
    when the memory being read may change: at the end of each request)."""

    def __init__(self, copies: Copies, size: int) -> None:
        self._copies = copies
        self._free = [_Buffer(copies, size) for _ in range(2)]
        self._current: _Buffer | None = None  # the chunk last handed out
        self._ahead: _Buffer | None = None  # the chunk being gathered for the next take

    def take(
        self, key: Hashable, parts: Parts, then: tuple[Hashable, Parts] | None = None
    ) -> memoryview:
        try:
            if self._current is None or self._current.key != key:
                self._release_current()
                if self._ahead is not None and self._ahead.key == key:
                    self._current, self._ahead = self._ahead, None
                else:
                    self._current = self._issue(self._free.pop(), key, parts)
            if then is not None and then[0] != key:
                self._prefetch(*then)
            current = self._current
            current.event.synchronize()  # this buffer's copy only
            return current.view[: current.length]
        except BaseException:
            self._forget()
            raise

    def drain(self) -> None:
        """Wait for every copy still running, then forget every buffer's chunk."""
        try:
            for buf in self._buffers():
                buf.event.synchronize()
        finally:
            self._forget()

    def _buffers(self) -> list[_Buffer]:
        return [b for b in (self._current, self._ahead, *self._free) if b is not None]

    def _release_current(self) -> None:
        if self._current is not None:
            self._free.append(self._current)
            self._current = None

    def _prefetch(self, key: Hashable, parts: Parts) -> None:
        if self._ahead is not None:
            if self._ahead.key == key:
                return
            self._free.append(self._ahead)  # gathering a chunk no longer asked for next
            self._ahead = None
        self._ahead = self._issue(self._free.pop(), key, parts)

    def _issue(self, buf: _Buffer, key: Hashable, parts: Parts) -> _Buffer:
        buf.event.synchronize()  # reuse a buffer only after its last copy finished
        buf.key = None
        pairs = buf.pairs(parts(), into_host=True)
        buf.event = self._copies.copy(pairs)
        buf.key = key
        return buf

    def _forget(self) -> None:
        bufs = self._buffers()
        for buf in bufs:
            buf.key = None
        self._free, self._current, self._ahead = bufs, None, None


class ScatterBehind:
    """Receive side: host→device copies of received chunks, committed once they finished.

    `sink(n)` hands out a free buffer to receive a chunk into (if both hold copies still
    pending, the older one is waited for and committed first); `issue(parts, tag,
    on_done)` starts copying that buffer to the chunk's device memory; `on_done` runs, and
    `tag` joins `settled()`, only after that copy's event completed — from `sink`, `poll`,
    `settled` or `flush`, in issue order. A buffer received into but never issued (a chunk
    that failed its checksum) is simply reused. `flush` waits for every pending copy and
    commits it; if waiting for a copy fails, no pending chunk is committed and none stays
    pending."""

    def __init__(self, copies: Copies, size: int) -> None:
        self._copies = copies
        self._buffers = [_Buffer(copies, size) for _ in range(2)]
        self._pending: deque[_Buffer] = deque()  # copies issued, chunks not yet committed
        self._receiving: _Buffer | None = None  # the buffer last handed out by `sink`
        self._settled: list[int] = []  # tags committed and not yet reported

    @property
    def pending(self) -> int:
        """Copies issued whose chunks are not committed yet."""
        return len(self._pending)

    def sink(self, nbytes: int) -> memoryview:
        self._receiving = None
        self.poll()
        free = [b for b in self._buffers if b not in self._pending]
        if not free:
            self._settle(self._pending[0], wait=True)
            free = [b for b in self._buffers if b not in self._pending]
        buf = free[0]
        self._guard(buf.event.synchronize)  # reuse a buffer only after its last copy finished
        if nbytes > buf.host.numel():
            raise InvalidArgument(f"a chunk of {nbytes} B does not fit {buf.host.numel()} B")
        self._receiving = buf
        return buf.view[:nbytes]

    def issue(self, parts: Sequence[torch.Tensor], tag: int, on_done: Callable[[], None]) -> None:
        buf, self._receiving = self._receiving, None
        if buf is None:
            raise InvalidArgument("no received chunk to copy: sink() first")
        pairs = buf.pairs(parts, into_host=False)
        buf.event = self._copies.copy(pairs)
        buf.tag, buf.on_done = tag, on_done
        self._pending.append(buf)

    def poll(self) -> None:
        """Commit, in order, every pending chunk whose copy has finished (never blocks)."""
        while self._pending and self._settle(self._pending[0], wait=False):
            pass

    def settled(self) -> list[int]:
        """The tags committed since the last call, in issue order (after a `poll`)."""
        self.poll()
        out, self._settled = self._settled, []
        return out

    def flush(self) -> list[int]:
        """Wait for every pending copy and commit it; the tags not yet reported, in order."""
        self._receiving = None
        while self._pending:
            self._settle(self._pending[0], wait=True)
        return self.settled()

    def _settle(self, buf: _Buffer, *, wait: bool) -> bool:
        """Commit `buf`'s chunk if its copy finished (waiting for it if `wait`)."""
        done = self._guard(buf.event.synchronize if wait else buf.event.query)
        if done is False:
            return False
        self._pending.popleft()
        on_done, buf.on_done = buf.on_done, None
        if on_done is not None:
            on_done()
        self._settled.append(buf.tag)
        return True

    def _guard(self, wait: Callable[[], bool | None]) -> bool | None:
        """Run `wait`; if it fails, drop every pending chunk uncommitted, then raise."""
        try:
            return wait()
        except BaseException:
            for buf in self._pending:
                buf.on_done = None
            self._pending.clear()
            self._receiving = None
            raise
