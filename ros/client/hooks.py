"""Where fault injection enters a client: `ClientHooks`, given once at `ros.connect(...,
hooks=...)`. Each hook is a wrapper around the real object (or the real function itself),
so production code has no switch to read: the defaults are production's objects, unwrapped.

Chaos runs (`chaos.planted`, `chaos.holder_faults`) and tests pass other hooks to plant a
bug or make the client's holder misbehave, so that a checker can be shown to notice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from consistency.floor import RevisionFloor
from transport.ranged import read_ranges
from transport.reader import Round, read_round
from transport.server import ChunkSender, send_chunk

RoundReader = Callable[..., Round]
"""One round of a fetch: `transport.reader.read_round`'s signature."""


RangeReader = Callable[..., int]
"""A read of byte ranges of chunks: `transport.ranged.read_ranges`'s signature."""


def unwrapped_floor(floor: RevisionFloor) -> RevisionFloor:
    """Production's floor hook: the floor itself."""
    return floor


def unwrapped_reader(read: RoundReader) -> RoundReader:
    """Production's reader hook: `read_round` itself."""
    return read


def unwrapped_ranges(read: RangeReader) -> RangeReader:
    """Production's range-reader hook: `read_ranges` itself."""
    return read


@dataclass(frozen=True)
class ClientHooks:
    """The seams of one client, fixed when it is built."""

    floor: Callable[[RevisionFloor], RevisionFloor] = unwrapped_floor  # wraps the floor
    read: Callable[[RoundReader], RoundReader] = unwrapped_reader  # wraps `read_round`
    send: ChunkSender = send_chunk  # how this client's holder server sends each chunk
    ranges: Callable[[RangeReader], RangeReader] = unwrapped_ranges  # wraps `read_ranges`

    def reader(self) -> RoundReader:
        """The round reader the client's fetches use."""
        return self.read(read_round)

    def range_reader(self) -> RangeReader:
        """The reader of byte ranges the client's first layout readers use."""
        return self.ranges(read_ranges)


PRODUCTION = ClientHooks()
