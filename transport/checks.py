"""What a reader verifies of every chunk it receives, as one object fixed when a fetch
(or an SDK client) is built.

Production always uses `STRICT`. The checks are an argument, not a switch read from the
environment, so that the reader's hot path reads no global state per chunk and a chaos run
can plant a bug (a reader that skips them, to prove its checker notices: docs/chaos.md)
by passing another `ChunkChecks` from outside (`chaos.planted`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkChecks:
    """Which checks a reader runs on each CHUNK before it marks the chunk present."""

    version: bool = True  # the header names the tenant, model and version asked for
    checksum: bool = True  # the payload's xxh3-64 matches the header's
    manifest: bool = True  # the header's checksum matches the publisher's manifest


STRICT = ChunkChecks()
"""Every check on: what every production reader uses."""
