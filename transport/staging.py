"""Pinned host staging for CUDA tensors on the TCP path.

Sockets can only read and write host memory, so a chunk of a CUDA-resident version goes
through one pinned host buffer per connection: gathered device→host before a send,
received into the buffer and scattered host→device after its checksum passed. Pinned
memory makes those copies DMA transfers at full PCIe/NVLink-C2C speed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from transport.layout import Segment


class StagingBuffer:
    """One pinned host buffer of `size` bytes, reused for every chunk of a connection."""

    def __init__(self, size: int) -> None:
        self.tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        self.view = self.tensor.numpy().data.cast("B")

    def gather(self, flats: Sequence[torch.Tensor], segments: Sequence[Segment]) -> memoryview:
        """Copy the device bytes of `segments` into this buffer; return the filled prefix."""
        pos = 0
        for seg in segments:
            src = flats[seg.tensor][seg.start : seg.start + seg.length]
            self.tensor[pos : pos + seg.length].copy_(src, non_blocking=True)
            pos += seg.length
        torch.cuda.synchronize()
        return self.view[:pos]

    def scatter(self, flats: Sequence[torch.Tensor], segments: Sequence[Segment]) -> None:
        """Copy this buffer's prefix back to the device tensors of `segments`."""
        pos = 0
        for seg in segments:
            dst = flats[seg.tensor][seg.start : seg.start + seg.length]
            dst.copy_(self.tensor[pos : pos + seg.length], non_blocking=True)
            pos += seg.length
        torch.cuda.synchronize()
