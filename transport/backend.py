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
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from tensorhub.errors import InvalidArgument, NoUsableTransport

if TYPE_CHECKING:
    from transport.fetch_state import FetchState
    from transport.outcome import ChunkOutcome
    from transport.planner import Source
    from transport.staging import StagingBuffer
    from transport.store import HeldVersion


class TransportKind(enum.Enum):
    NIXL = "nixl"  # NVIDIA's NIXL over UCX (transport.nixl): opt-in, `enabled_transports`
    RDMA = "rdma"
    IPC = "ipc"  # same-host CUDA IPC (transport.ipc)
    TCP = "tcp"


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


def available_transports() -> list[TransportKind]:
    """Usable transports, best first: RDMA (only if `transport.rdma.rdma_available()`),
    same-host CUDA IPC (only with a CUDA device: `transport.ipc.ipc_available()`), then
    TCP, which is always available. A missing or broken RDMA module is not an error."""
    kinds: list[TransportKind] = []
    try:
        from transport import rdma

        if rdma.rdma_available():
            kinds.append(TransportKind.RDMA)
    except ImportError:
        pass
    from transport.ipc.availability import ipc_available

    if ipc_available():
        kinds.append(TransportKind.IPC)
    kinds.append(TransportKind.TCP)
    return kinds


ENV = "TENSORHUB_TRANSPORTS"
"""The environment variable naming a client's transports when `ros.connect` is given none:
comma-separated kinds, e.g. `nixl` or `nixl,tcp`."""


def enabled_transports(
    requested: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> tuple[TransportKind, ...]:
    """The transports one client serves and reads over, in `transport.selection`'s order.

    None (and no `TENSORHUB_TRANSPORTS` in `env`, default `os.environ`): every transport
    of `available_transports()`, that is RDMA and CUDA IPC where this machine has them, and
    TCP. NIXL is used only when named: UCX's settings are process-wide (read from `UCX_*`
    when an agent is made, and shared with any other NIXL user in the process, such as
    vLLM's NixlConnector), and on one host UCX reads through cma, past whatever network a
    deployment meant its bytes to cross (docs/design-notes.md, "pyverbs RDMA or NIXL").
    TCP is always in: a PARTIAL holder, a TLS client and every fallback read over it.

    A named kind this process cannot use is an error, with the reason
    (`NoUsableTransport`); an unknown name is `InvalidArgument`.
    """
    if requested is None:
        named = (env if env is not None else os.environ).get(ENV, "").strip()
        if not named:
            return tuple(available_transports())
        requested = [part.strip() for part in named.split(",") if part.strip()]
    kinds = {TransportKind.TCP}
    known = {kind.value: kind for kind in TransportKind}
    for name in requested:
        kind = known.get(name) if isinstance(name, str) else None
        if kind is None:
            raise InvalidArgument(f"unknown transport {name!r}: expected some of {sorted(known)}")
        why = unavailable_reason(kind)
        if why:
            raise NoUsableTransport(f"transport {name!r} was asked for but {why}")
        kinds.add(kind)
    order = [k for k in TransportKind if k in kinds]  # the enum is in preference order
    return tuple(order)


def unavailable_reason(kind: TransportKind) -> str:
    """Why this process cannot use `kind` ('' when it can). Probing NIXL imports it."""
    if kind is TransportKind.TCP:
        return ""
    if kind is TransportKind.NIXL:
        from transport.nixl.loader import unavailable_reason as nixl_reason

        return nixl_reason() or ""
    if kind is TransportKind.RDMA:
        try:
            from transport import rdma
        except ImportError as exc:
            return f"no RDMA here ({exc})"
        return "" if rdma.rdma_available() else f"no RDMA here ({rdma.rdma_unavailable_reason()})"
    from transport.ipc.availability import ipc_unavailable_reason

    return ipc_unavailable_reason() or ""
