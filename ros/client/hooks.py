"""Where fault injection enters a client: `ClientHooks`, given once at `ros.connect(...,
hooks=...)`. The defaults are production's, and production code reads nothing else (no
environment variable, no switch on a hot path).

Chaos runs (`chaos.planted`, `chaos.holder_faults`) and tests pass other hooks to plant a
bug or make the client's holder misbehave, so that a checker can be shown to notice.
"""

from __future__ import annotations

from dataclasses import dataclass

from consistency.floor import RevisionFloor
from transport.checks import STRICT, ChunkChecks
from transport.server import ChunkSender, send_chunk


@dataclass(frozen=True)
class ClientHooks:
    """The seams of one client, fixed when it is built."""

    checks: ChunkChecks = STRICT  # what every fetched chunk must pass (transport.checks)
    floor: type[RevisionFloor] = RevisionFloor  # the revision floor's class (invariant 3)
    send: ChunkSender = send_chunk  # how this client's holder server sends each chunk


PRODUCTION = ClientHooks()
