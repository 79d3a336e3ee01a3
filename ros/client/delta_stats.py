"""`DeltaStats`: what a fetch's delta did (`Held.delta`, `SliceFetch.deltas`). Apart from
the reader (`ros.client.delta_fetch`) so that the handles that carry it need none of it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class DeltaStats:
    """What a fetch's delta did (`Held.delta`); all zero when it read the version whole."""

    base: int = 0  # the version the destination held, that the deltas were applied to
    links: int = 0  # deltas applied one after the other (more than 1: a chain)
    chunks: int = 0  # chunks made from deltas
    encoded_bytes: int = 0  # bytes of the companions read (what crossed the network)
    # of those, by holder id (the fetch's `FetchStats.bytes_per_source` counts them too)
    bytes_per_source: dict[str, int] = field(default_factory=dict)
    whole_chunks: int = 0  # chunks left to be read whole (not encoded, or failed a check)
    base_mismatch: int = 0  # of those: the destination's bytes were not exactly the base's
    seconds: float = 0.0  # the delta's part of the fetch: plan, read, apply, verify
    fallback: str = ""  # why the delta was not used, or was used only in part

    def count_mismatch(self) -> None:
        """One more chunk whose destination bytes were not exactly the base's."""
        self.base_mismatch += 1

    def count(self, nbytes: int, sources: Mapping[str, int]) -> None:
        """A companion read: its bytes, and who sent them."""
        self.encoded_bytes += nbytes
        for source, sent in sources.items():
            self.bytes_per_source[source] = self.bytes_per_source.get(source, 0) + sent


def summed(deltas: Mapping[int | None, DeltaStats]) -> DeltaStats | None:
    """What the deltas of a `fetch_slices`'s source shards did, together (None: every
    shard was read whole): counts and seconds added, the oldest base, the longest chain,
    each shard's `fallback` named by its shard."""
    if not deltas:
        return None
    every = list(deltas.values())
    return DeltaStats(
        base=min(d.base for d in every),
        links=max(d.links for d in every),
        chunks=sum(d.chunks for d in every),
        encoded_bytes=sum(d.encoded_bytes for d in every),
        whole_chunks=sum(d.whole_chunks for d in every),
        base_mismatch=sum(d.base_mismatch for d in every),
        seconds=sum(d.seconds for d in every),
        fallback="; ".join(f"shard {s}: {d.fallback}" for s, d in deltas.items() if d.fallback),
    )
