"""Host staging of a CUDA-resident version on the TCP path: one `StagingBuffer` per
connection (a holder's connection thread, a reader's worker).

Sockets can only read and write host memory, so a chunk of a CUDA-resident version
crosses a host buffer: gathered device→host before a send, received into it and
scattered host→device after its checksum passed. `StagingBuffer` double-buffers each
direction (`transport.pipeline`) with copies on a dedicated CUDA stream
(`transport.copies.CudaCopies`, pinned buffers: DMA at full PCIe/NVLink-C2C speed), so the
copies overlap the network instead of waiting for it. Each direction's two buffers of
`size` bytes are allocated on first use, so a connection that only sends, or only
receives, holds two, not four.

`HeldVersion.source_views`, `sink_views` and `commit` are the only callers; a received
chunk is committed (marked present) only once its copy to the device completed, which
`settled` and `flush` report.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

import torch

from transport.copies import Copies, CudaCopies
from transport.pipeline import GatherAhead, Parts, ScatterBehind


class StagingBuffer:
    """Double-buffered host staging of chunks of up to `size` bytes, used by one thread at
    a time. `copies` defaults to `CudaCopies(devices)`: pinned buffers and a copy stream per
    device, each waiting once, at creation, on that device's current stream in the
    creating thread (so create it where the tensors were produced or allocated)."""

    def __init__(
        self, size: int, devices: Iterable[torch.device] = (), copies: Copies | None = None
    ) -> None:
        self.size = size
        self._copies = copies if copies is not None else CudaCopies(devices)
        self._gather: GatherAhead | None = None
        self._scatter: ScatterBehind | None = None

    @classmethod
    def for_tensors(cls, size: int, tensors: Iterable[torch.Tensor]) -> StagingBuffer:
        """Staging for chunks of `tensors` (copy streams on the CUDA devices they are on)."""
        return cls(size, {t.device for t in tensors if t.is_cuda})

    # -- send side -----------------------------------------------------------------------

    def gather(
        self, key: Hashable, parts: Parts, then: tuple[Hashable, Parts] | None = None
    ) -> memoryview:
        """Chunk `key`'s bytes (copied from `parts()` unless already staged) in host memory,
        once its copy completed; `then`, the chunk to be asked for next, starts gathering
        into the other buffer first. Valid until the next call (`GatherAhead.take`)."""
        if self._gather is None:
            self._gather = GatherAhead(self._copies, self.size)
        return self._gather.take(key, parts, then)

    def drain(self) -> None:
        """Wait for every device→host copy still running and forget what is staged: at the
        end of a request, before the memory read may change (a released version)."""
        if self._gather is not None:
            self._gather.drain()

    # -- receive side --------------------------------------------------------------------

    def sink(self, nbytes: int) -> memoryview:
        """A free host buffer to receive a chunk of `nbytes` into (`ScatterBehind.sink`)."""
        return self._scattering().sink(nbytes)

    def scatter(self, parts: Sequence[torch.Tensor], tag: int, on_done: Callable[[], None]) -> None:
        """Start copying the chunk last received (`sink`) into `parts`; `on_done` (the
        commit) runs once that copy completed, and `tag` is then `settled`."""
        self._scattering().issue(parts, tag, on_done)

    def _scattering(self) -> ScatterBehind:
        if self._scatter is None:
            self._scatter = ScatterBehind(self._copies, self.size)
        return self._scatter

    @property
    def pending(self) -> int:
        """Received chunks whose copy to the device has not been committed yet."""
        return 0 if self._scatter is None else self._scatter.pending

    def settled(self) -> list[int]:
        """Tags of the chunks committed since the last call, in order (never blocks)."""
        return [] if self._scatter is None else self._scatter.settled()

    def flush(self) -> list[int]:
        """Complete and commit every pending copy; the tags not yet reported, in order."""
        return [] if self._scatter is None else self._scatter.flush()

    def close(self) -> None:
        """Flush the receive side and drain the send side (idempotent)."""
        try:
            self.flush()
        finally:
            self.drain()
