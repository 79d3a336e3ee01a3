"""The backend interface: what one transport does on each side of a transfer.

Every data-plane transport (TCP, pyverbs RDMA, same-host CUDA IPC, and any later one such
as NIXL) is two objects, each owned by one client and built, started and closed by it;
none keeps state at module level, and building a message (a holder record) starts
nothing.

**Holder side** (`HolderBackend`; `ros.client.serving` owns one per transport served):

1. `start`: listen where readers reach it (its `address`, advertised in the holder
   record as this kind's endpoint);
2. `register(held)`: make a held version's memory readable by this backend (TCP reads it
   where it is; RDMA registers it with the NIC on the first reader that asks; IPC exports
   it per lease). Nothing is shared before a request passes the read-token check
   (`transport.verifier.lookup`) on this backend's own channel: the TCP GET, the RDMA or
   IPC control request (the hand-shake: queue-pair numbers, keys, IPC handles travel on
   it, never into etcd);
3. every read or lease counts as one read in flight of the version
   (`HeldVersion.reading()`), so `HolderStore.release` refuses new reads at once and waits
   for the running ones; on its way out the version's epoch turns odd and a one-sided
   reader whose copy overlapped it drops that copy (`transport.rdma.seqlock.epoch_ok`);
4. `release(held)`: after that release, drop what `register` built (deregister memory,
   forget exports);
5. `stop`: stop listening and cut every connection.

**Reader side** (`ReaderBackend`; `transport.transports.ReaderBackends` holds one per
transport for one client):

1. `open(f, source, staging)`: a `Channel` to one holder for one worker of fetch `f`
   (`transport.fetch_state.FetchState`: the sink, the deadline, the token, the checks);
   it connects on its first read;
2. `Channel.read(chunks)`: read them into the sink, each checked against the manifest
   (`transport.verification`) before it is committed, and give one typed
   `transport.outcome.ChunkOutcome` per chunk, in order, ending after the first that is
   not DONE; never raise for the holder's faults;
3. `Channel.close()`; and `ReaderBackend.close()` at the client's close (RDMA: its
   opened device).

This module is the interface only, importing no backend: which transports this process can
use, and which a client enables, is `transport.registry`'s; one client's reader backends are
`transport.transports.ReaderBackends`; the kinds are `transport.kinds.TransportKind`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from transport.kinds import TransportKind

if TYPE_CHECKING:
    from transport.fetch_state import FetchState
    from transport.outcome import ChunkOutcome
    from transport.planner import Source
    from transport.staging import StagingBuffer
    from transport.store import HeldVersion


__all__ = ["Channel", "HolderBackend", "ReaderBackend", "TransportKind"]


class HolderBackend(Protocol):
    """The holder side of one transport (module docstring, steps 1-5)."""

    kind: TransportKind

    @property
    def address(self) -> tuple[str, int]:
        """Where readers reach it (`TransportError` before `start`)."""
        ...

    def start(self) -> object:
        """Listen; idempotence is the caller's (`ros.client.serving.Serving.start`)."""
        ...

    def register(self, held: HeldVersion) -> None:
        """Make `held`'s memory readable over this backend once a token allows it."""
        ...

    def release(self, held: HeldVersion) -> None:
        """`held` was released (its reads in flight waited for): drop what `register`
        built for it."""
        ...

    def stop(self) -> None:
        """Stop listening and cut every connection."""
        ...


class Channel(Protocol):
    """An open way to one holder, used by one worker thread at a time."""

    def read(self, chunks: Sequence[int]) -> Iterator[ChunkOutcome]:
        """Read `chunks` into the sink: one outcome each, in order, ending after the first
        that is not DONE. Never raises for the holder's faults (they are outcomes)."""
        ...

    def close(self) -> None:
        """Release the connection (idempotent)."""
        ...


class ReaderBackend(Protocol):
    """The reader side of one transport (module docstring)."""

    kind: TransportKind

    def open(self, f: FetchState, source: Source, staging: StagingBuffer | None) -> Channel:
        """A channel to `source` for fetch `f`; it connects on its first read."""
        ...

    def close(self) -> None:
        """Free what this backend opened for its channels (idempotent)."""
        ...


def __getattr__(name: str) -> Any:
    """`enabled_transports` moved to `transport.registry`; this forward serves an importer
    that has not followed yet, and goes once none is left."""
    if name == "enabled_transports":
        from transport.registry import enabled_transports

        return enabled_transports
    raise AttributeError(f"module 'transport.backend' has no attribute {name!r}")
