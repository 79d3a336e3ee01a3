"""`SliceFetch`: what a read of slices (`ros.client.slices.fetch_slices`) read, and how the
source shards' reads, each in a thread of its own, add up into it (`merge`).

A module of its own because every part of the read fills one (the reads of the source
shards, `ros.client.slice_read`; the layout reader's, `ros.client.slice_layout`), and the
SDK's callers take it (`ros.SliceFetch`) without the read's machinery.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ros.client.delta_stats import DeltaStats
from transport.outcome import FetchStats, add_moved


@dataclass
class SliceFetch:
    """What `fetch_slices` read: the version, bytes per source holder, and the holders
    that failed (and why) before their chunks were read elsewhere."""

    version: int
    bytes_per_source: dict[str, int] = field(default_factory=dict)
    chunks: int = 0
    failed_sources: dict[str, str] = field(default_factory=dict)
    slow_sources: dict[str, float] = field(default_factory=dict)  # under the rate floor: B/s
    # delta=True: what the delta did for each source shard read (None: the whole version)
    deltas: dict[int | None, DeltaStats] = field(default_factory=dict)
    # layout=...: the blocks read from the trainer's shards (the others came from holders
    # of the same blocks), and whether this reader serves its blocks now
    from_trainer: set[str] = field(default_factory=set)
    served: bool = False
    # layout=...: the chunks read from peers (holders of the same blocks, or of a cover's
    # block sets) that were checked against the publisher's checksums (a layout declared
    # before the version's publish; 0: all against the reader-derived ones)
    publisher_checked: int = 0
    # layout=... declared before the publish: why reads of the trainer's byte ranges fell
    # back to whole chunks, and the chunks of the block set that failed the publisher's
    # check (their trainer chunks then read whole); empty when every range was good
    range_failures: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_source.values())


def merge(result: SliceFetch, part: SliceFetch) -> None:
    """Add what one source shard's pipeline read to `result`."""
    moved = FetchStats()
    moved.bytes_per_source.update(part.bytes_per_source)
    moved.chunks = part.chunks
    moved.failed_sources.update(part.failed_sources)
    moved.slow_sources.update(part.slow_sources)
    add_moved(result, moved)
