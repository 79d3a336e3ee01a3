"""One client's reader backends (`ReaderBackends`): the reader side of each transport
(`transport.backend.ReaderBackend`), built when first asked for.

A reader backend opens a `Channel` to a holder (`Source`, whose host:port is that
transport's endpoint); a channel reads a set of chunks into the fetch's sink (`FetchState.dest`, a
PARTIAL `HeldVersion`, through `staging` for CUDA tensors) and gives back one typed
`ChunkOutcome` per chunk, in order, stopping after the first that is not DONE (done, not
ready, corrupt, denied, released, failed: `transport.outcome.ChunkStatus`). The reader
(`transport.reader`) plans, steals, fails over and counts on those outcomes alone, so it
runs unchanged over every transport:

- `TcpTransport` (`transport.tcp`): GET frames over a socket, payloads received in place
  (`transport.receiving`);
- `RdmaTransport` (`transport.rdma.channel`): a descriptor over a TCP control channel,
  then one-sided reads;
- `IpcTransport` (`transport.ipc.channel`): a lease on a same-host holder's GPU memory,
  copied device to device (falling back to TCP, with the reason, when it cannot map);
- `NixlReader` (`transport.nixl.reader`): agent metadata over a TCP control channel, then
  one-sided NIXL READs into the destination.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from tensorhub.errors import TransportError
from transport.backend import ReaderBackend
from transport.kinds import TransportKind
from transport.registry import enabled_transports
from transport.tcp import TcpTransport

__all__ = ["ReaderBackends"]


class ReaderBackends:
    """One client's reader backends, one per kind, each built when first asked for (RDMA's,
    IPC's and NIXL's modules are imported only then) and closed with the client (`close`).
    `kinds`: the transports this client reads over (`transport.registry.enabled_transports`;
    default: what this machine has, NIXL only when asked for). `verdicts`: the holders
    whose CUDA IPC failed lately, written by this client's IPC channels and read when it
    chooses a transport (`transport.selection`)."""

    def __init__(self, kinds: Sequence[TransportKind] | None = None) -> None:
        from transport.ipc.fingerprint import Verdicts

        self.kinds = tuple(enabled_transports() if kinds is None else kinds)
        self.verdicts = Verdicts()
        self._lock = threading.Lock()
        self._made: dict[TransportKind, ReaderBackend] = {}

    def get(self, kind: TransportKind) -> ReaderBackend:
        with self._lock:
            backend = self._made.get(kind)
            if backend is None:
                backend = self._made[kind] = self._make(kind)
            return backend

    def _make(self, kind: TransportKind) -> ReaderBackend:
        if kind is TransportKind.NIXL:
            from transport.nixl.reader import NixlReader

            return NixlReader()
        if kind is TransportKind.RDMA:
            from transport.rdma.channel import RdmaTransport

            return RdmaTransport()
        if kind is TransportKind.IPC:
            from transport.ipc.channel import IpcTransport

            return IpcTransport(self.verdicts)
        if kind is TransportKind.TCP:
            return TcpTransport()
        raise TransportError(f"no transport of kind {kind!r}")

    def close(self) -> None:
        with self._lock:
            made, self._made = list(self._made.values()), {}
        for backend in made:
            backend.close()
