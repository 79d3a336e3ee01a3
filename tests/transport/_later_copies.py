"""`LaterCopies`: a copy engine for the staging tests on the CPU that behaves like a CUDA
copy stream. Copies run in issue order, only when an event is waited for (or queried, for
a "fast device"), and until then their destination holds poison bytes. It also fails the
test if a copy is issued on a host buffer that a copy still pending uses (a buffer reused
before its event completed). The pipelines, `HeldVersion`, server and channel under test
are the real ones; only this engine stands in for the device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from transport.copies import Pair

POISON = 0xEE


class LaterEvent:
    """One batch of `LaterCopies`: done once run."""

    def __init__(self, copies: LaterCopies, pairs: Sequence[Pair]) -> None:
        self.copies, self.pairs, self.done = copies, list(pairs), False

    def query(self) -> bool:
        if self.copies.fast and not self.done:
            self.copies.run_until(self)
        return self.done

    def synchronize(self) -> None:
        self.copies.run_until(self)


class LaterCopies:
    """Copies that happen later, in order, like a copy stream's (see the module doc)."""

    def __init__(self, *, fast: bool = False) -> None:
        self.fast = fast  # a query runs the queue up to its event (a device that keeps up)
        self.queue: deque[LaterEvent] = deque()
        self.hosts: set[int] = set()  # storages handed out by host_buffer
        self.issued = 0  # copies issued (pairs)
        self.most = 0  # the most batches ever in flight at once
        self.fail = False  # the next event run raises, like a CUDA error

    def host_buffer(self, size: int) -> torch.Tensor:
        t = torch.full((size,), POISON, dtype=torch.uint8)
        self.hosts.add(t.untyped_storage().data_ptr())
        return t

    def _host_ranges(self, pairs: Sequence[Pair]) -> set[tuple[int, int, int]]:
        out = set()
        for dst, src in pairs:
            for t in (dst, src):
                base = t.untyped_storage().data_ptr()
                if base in self.hosts:
                    start = int(t.storage_offset())
                    out.add((base, start, start + t.numel()))
        return out

    def copy(self, pairs: Sequence[Pair]) -> LaterEvent:
        mine = {base for base, _, _ in self._host_ranges(pairs)}
        busy = {base for e in self.queue for base, _, _ in self._host_ranges(e.pairs)}
        assert not mine & busy, "a host buffer was reused while a copy on it was pending"
        for dst, _ in pairs:
            dst.fill_(POISON)  # in flight: undefined until the event completes
        event = LaterEvent(self, pairs)
        self.queue.append(event)
        self.issued += len(pairs)
        self.most = max(self.most, len(self.queue))
        return event

    def run_until(self, event: LaterEvent) -> None:
        while not event.done:
            head = self.queue.popleft()
            if self.fail:
                self.fail = False
                raise RuntimeError("copy failed (simulated device error)")
            for dst, src in head.pairs:
                dst.copy_(src)
            head.done = True
