"""How staged bytes move between host buffers and tensors: at once on the CPU, or
asynchronously on a dedicated CUDA copy stream, each batch of copies followed by an event.

The staging pipelines (`transport.pipeline`) are written against `Copies` and `Event`
alone, so the same bookkeeping (which buffer is free, when a chunk may be committed) runs
with any `Copies`: `CudaCopies` on a GPU, where a copy is done when its event says so, or
synchronous host copies (the CPU tests' own), done when they return with `DONE`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

Pair = tuple[torch.Tensor, torch.Tensor]
"""(destination, source): two 1-D uint8 tensors of the same length, one of them host memory."""


class Event(Protocol):
    """The completion of one batch of copies."""

    def query(self) -> bool:
        """Whether every copy of the batch has finished (never blocks)."""
        ...

    def synchronize(self) -> None:
        """Block until every copy of the batch has finished."""
        ...


class Copies(Protocol):
    """Host buffers and the copies between them and tensors."""

    def host_buffer(self, size: int) -> torch.Tensor:
        """A 1-D uint8 host tensor of `size` bytes to stage chunks in."""
        ...

    def copy(self, pairs: Sequence[Pair]) -> Event:
        """Start `dst.copy_(src)` for every pair, in order; the event completes when all
        have. Until then neither side of any pair may be touched."""
        ...


class Done:
    """An event that has already completed: what a synchronous copy returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


DONE = Done()


class CudaEvents:
    """The events of one batch of copies: one per CUDA device whose stream it used."""

    def __init__(self, events: Sequence[torch.cuda.Event]) -> None:
        self._events = list(events)

    def query(self) -> bool:
        # torch leaves Event.query, Event() and Stream() unannotated: hence the ignores
        return all(bool(e.query()) for e in self._events)  # type: ignore[no-untyped-call]

    def synchronize(self) -> None:
        for e in self._events:
            e.synchronize()  # this event only: never a device-wide synchronize


class CudaCopies:
    """Pinned host buffers, and copies issued with `non_blocking=True` on a dedicated copy
    stream per CUDA device, so they run while the calling thread does socket I/O.

    Ordering with the stream that produced the tensors: when a device's copy stream is
    created it waits (`wait_stream`) on that device's current stream *in the creating
    thread*, once. Streams are created in `__init__` for `devices`, and on first use for
    any other device. Work queued on the producer's stream later is not waited for: a
    version must be completely written before a staging created earlier copies it (a
    publisher's checksum pass at publish time waits for its tensors; a fetch's
    destination is allocated before its staging is created). The copies never wait for
    unrelated work (a training step queued after publish), as a device-wide synchronize
    would.

    No `record_stream` is needed: every copy's event is waited for before the read or
    fetch that issued it ends (`transport.pipeline`), while the tensors are still
    referenced, so the caching allocator cannot hand their memory to another stream
    during a copy.
    """

    def __init__(self, devices: Iterable[torch.device] = ()) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        for device in devices:
            self._stream(device)
        if not self._streams:
            self._stream(torch.device("cuda"))

    def _stream(self, device: torch.device) -> tuple[int, torch.cuda.Stream]:
        """The copy stream of `device` (its index, it), created on first use."""
        index = torch.cuda.current_device() if device.index is None else device.index
        stream = self._streams.get(index)
        if stream is None:
            stream = torch.cuda.Stream(index)  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream(index))
            self._streams[index] = stream
        return index, stream

    def host_buffer(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def copy(self, pairs: Sequence[Pair]) -> Event:
        by_stream: dict[int, tuple[torch.cuda.Stream, list[Pair]]] = {}
        for dst, src in pairs:
            index, stream = self._stream(dst.device if dst.is_cuda else src.device)
            by_stream.setdefault(index, (stream, []))[1].append((dst, src))
        events: list[torch.cuda.Event] = []
        for stream, group in by_stream.values():
            with torch.cuda.stream(stream):
                for dst, src in group:
                    dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
            events.append(event)
        return CudaEvents(events)
