"""The holder side of the NIXL backend: register held memory, hand it out under the read
token, and keep a release waiting for the reads in flight.

One `NixlHolder` owns one NIXL agent (UCX backend, with its progress thread: over UCX's TCP
transport that thread serves the readers' READs) and one control port
(`transport.nixl.protocol`). A version's tensors are registered with the agent on the first
request that passes the token check, not before: a version no NIXL reader asks for costs no
registration. The steps, after NIXL's own register → prepare → transfer → check sequence:

    holder: register(held tensors)                    (first accepted request)
    holder: offer = agent metadata + one region per tensor, over the control channel only
    reader: add_remote_agent, READ, check             (transport.nixl.reader)
    holder: begin/end around each READ, counted in HeldVersion.reading()
    holder: deregister                                (released, and release has returned)
    holder: close the agent                           (its last registration is gone)

A release (`HolderStore.release`) refuses new batches at once and waits for the batches in
flight to end; once it has returned (or given up: the epoch is odd), the registration is
dropped. Deregistering alone revokes nothing over UCX's TCP and cma transports: a reader
that kept the metadata could still READ the old regions (docs/nixl.md, "Security"). So a
release also retires the agent that registered the version: later registrations go to a
fresh agent, and the old one is closed once its last registration is dropped, which
disconnects every reader of it (their READs fail with NIXL's remote-disconnect error).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import uuid
from dataclasses import dataclass
from typing import Any, Self, Unpack

from tensorhub.errors import TransportError, VersionUnavailable
from transport.admission import Conn
from transport.backend import TransportKind
from transport.frames import recv_message, send_message
from transport.listener import ControlServer, PortLimits
from transport.nixl.loader import load
from transport.nixl.progress import Pump
from transport.nixl.protocol import (
    BEGIN,
    END,
    GO,
    MAX_REQUEST_BYTES,
    NixlOffer,
    decode_op,
    decode_request,
    encode_offer,
    encode_op,
    encode_refusal,
)
from transport.store import HeldVersion, HolderStore
from transport.verifier import Refused, Verifier, lookup
from transport.wire import ErrorCode, Refusal

log = logging.getLogger(__name__)

POLL = 0.05  # seconds between looks at `released` while a reader's channel is idle


def agent_name(role: str) -> str:
    """A NIXL agent name no other agent of any process shares (agents are keyed by name)."""
    return f"tensorhub-{role}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def new_agent(role: str) -> Any:
    """A NIXL agent with the UCX backend, safe to call from several threads at once (NIXL's
    default without a listener thread is not: a reader's channels run in the fetch's worker
    threads, a holder's in its connection threads), and without NIXL's progress thread,
    which spins a core per agent: its owner progresses it (`transport.nixl.progress`)."""
    nixl = load()
    strict = nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    config = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"], sync_mode=strict)
    return nixl.nixl_agent(agent_name(role), config)


@dataclass
class _Registration:
    """One held version's memory, registered with `agent`. The registrations are the only
    holders of a retired agent: it closes when the last of them is dropped."""

    held: HeldVersion
    agent: Any  # the nixl_agent it is registered with
    descs: Any  # the nixlRegDList to deregister (None: every tensor is empty)
    regions: tuple[tuple[int, int], ...]
    batches: int = 0  # READs in flight now, between `begin` and `end`


class NixlHolder(ControlServer):
    """Serves NIXL readers the versions in `store` whose token `verifier` accepts: the
    holder side of the NIXL backend (`transport.backend.HolderBackend`; its owner tells it
    of each version and release through `HolderStore.watch(holder.register,
    holder.release)`). Only COMPLETE versions in host memory are offered (a PARTIAL one is
    NOT_READY, as over RDMA: read it over TCP). Admission and the accept loop are
    `transport.listener`'s: the same rules as the TCP data port."""

    name = "nixl-control"
    kind = TransportKind.NIXL

    def __init__(
        self,
        store: HolderStore,
        verifier: Verifier,
        host: str = "127.0.0.1",
        port: int = 0,
        **limits: Unpack[PortLimits],
    ) -> None:
        super().__init__(store, verifier, host, port, **limits)
        self._agent: Any = None  # where new registrations go (made on first use)
        self._retired = 0  # agents retired so far (tests, metrics)
        self._regs: dict[int, _Registration] = {}  # id(held) -> its registration
        self._pump = Pump(f"{self.name}-progress")  # the agents' progress, while reads run

    @property
    def retired(self) -> int:
        """How many agents releases have retired (each disconnected its readers)."""
        return self._retired

    def start(self) -> Self:
        """Listen, with the agent made now rather than in the first reader's time."""
        with self._lock:
            if self._agent is None:
                self._agent = new_agent("holder")
        return super().start()

    def stop(self) -> None:
        """Stop accepting, cut every channel, deregister every version."""
        super().stop()
        self._pump.stop()
        with self._lock:
            regs, self._regs = list(self._regs.values()), {}
            self._agent = None
            for reg in regs:
                self._deregister(reg)

    def registered(self) -> int:
        """How many versions are registered with the agent now (tests, metrics)."""
        with self._lock:
            return len(self._regs)

    def register(self, held: HeldVersion) -> None:
        """Nothing yet: `held`'s memory is registered with NIXL for the first reader whose
        token passes (`_register`), so a version no NIXL reader asks for costs no
        registration."""

    def release(self, held: HeldVersion) -> None:
        """`held`'s release returned (or gave up waiting): deregister it and retire its
        agent once no READ of it is in flight (now, or at a later tick when the release
        gave up on one)."""
        self.tick()

    def refusal(self, code: ErrorCode, message: str) -> bytes:
        return encode_refusal(code, message)

    def tick(self) -> None:
        """Deregister released versions once their release has returned (or given up) and
        no READ of theirs is in flight."""
        with self._lock:
            done = [
                k
                for k, r in self._regs.items()
                if r.held.released and r.held.epoch & 1 and not r.batches
            ]
            for key in done:
                reg = self._regs.pop(key)
                if reg.agent is self._agent:  # retire it: the next version gets a new one
                    self._agent = None
                    self._retired += 1
                self._deregister(reg)
            # Dropping `reg` drops a retired agent's last reference once none of its
            # versions is left: it closes, and its readers are disconnected.

    def _deregister(self, reg: _Registration) -> None:
        if reg.descs is None:
            return
        try:
            reg.agent.deregister_memory(reg.descs)
        except Exception as exc:  # NIXL's own errors: logged, never fatal to the port
            log.warning("NIXL deregistration of %s failed: %r", reg.held.key, exc)

    # -- one reader's channel ------------------------------------------------------------

    def serve(self, record: Conn) -> None:
        req = self.request(record, decode_request, MAX_REQUEST_BYTES)
        if req is None:
            return
        key = (req.tenant, req.model, req.version)
        on_cuda = "in GPU memory (not served yet)"
        found = self.offered(record, key, req.token, req.layout_digest, on_cuda=on_cuda)
        if found is None:
            return
        conn = record.sock
        try:
            reg = self._register(found)
        except VersionUnavailable as exc:
            self.refuse(conn, ErrorCode.RELEASED, str(exc))
            return
        except TransportError as exc:
            self.refuse(conn, ErrorCode.BAD_REQUEST, str(exc))
            return
        send_message(conn, encode_offer(self._offer(reg)))
        self._session(conn, reg)

    def _register(self, held: HeldVersion) -> _Registration:
        with self._lock:
            if held.released:
                raise VersionUnavailable(f"{held.key} is released on this holder")
            reg = self._regs.get(id(held))
            if reg is not None:
                return reg
            tensors = [t for t in held.tensors.values() if t.numel()]
            regions = tuple(
                (t.data_ptr(), t.numel() * t.element_size()) if t.numel() else (0, 0)
                for t in held.tensors.values()
            )
            if self._agent is None:
                self._agent = new_agent("holder")
            try:
                descs = self._agent.register_memory(tensors) if tensors else None
            except Exception as exc:
                raise TransportError(f"NIXL cannot register {held.key}: {exc!r}") from exc
            reg = self._regs[id(held)] = _Registration(held, self._agent, descs, regions)
            return reg

    def _offer(self, reg: _Registration) -> NixlOffer:
        with self._lock:
            metadata = bytes(reg.agent.get_agent_metadata())
            name = str(reg.agent.name)
        return NixlOffer(name, metadata, reg.regions)

    def _session(self, conn: socket.socket, reg: _Registration) -> None:
        """Answer `begin`/`end` until the reader leaves, the version is released, or we
        stop. A batch in flight holds one `reading()` of the version, so a release waits
        for it; a release that gave up ends the channel even mid-batch."""
        held = reg.held
        batch: contextlib.ExitStack | None = None
        try:
            while not self.stopping.is_set():
                if held.released and batch is None:
                    message = f"{held.key} is released on this holder"
                    with contextlib.suppress(OSError):
                        self.refuse(conn, ErrorCode.RELEASED, message)
                    return
                if held.released and held.epoch & 1:
                    return  # the release gave up waiting for this batch
                ready, _, _ = select.select([conn], [], [], POLL)
                if not ready:
                    continue
                try:
                    op = decode_op(recv_message(conn, MAX_REQUEST_BYTES))
                except TransportError as exc:  # the reader left (or spoke nonsense)
                    log.debug("NIXL reader channel ended: %s", exc)
                    return
                if isinstance(op, Refusal):
                    log.info("NIXL reader sent a refusal out of turn: channel closed")
                    return
                if op.name == BEGIN and batch is None:
                    batch = self._begin(conn, reg, op.token)
                    if batch is None:
                        return
                elif op.name == END and batch is not None:
                    batch.close()
                    batch = None
                    self.tick()
                else:  # a reader that does not follow the protocol loses its channel
                    log.info("NIXL reader sent %r out of turn: channel closed", op)
                    return
        finally:
            if batch is not None:
                batch.close()
                self.tick()

    def _begin(
        self, conn: socket.socket, reg: _Registration, token: bytes
    ) -> contextlib.ExitStack | None:
        """Check `token` again (it may have expired or been revoked since the channel
        opened), count a READ in flight and say `go`; None, after the refusal, when the
        token no longer passes or the version was released meanwhile."""
        held = reg.held
        found = lookup(self._store, self._verifier, held.key, token, held.layout.digest)
        if isinstance(found, Refused) or found is not held:
            refused = found if isinstance(found, Refused) else None
            code = refused.code if refused else ErrorCode.RELEASED
            message = refused.message if refused else f"{held.key} is no longer held here"
            self.refuse(conn, code, message)
            return None
        batch = contextlib.ExitStack()
        try:
            batch.enter_context(reg.held.reading())
        except VersionUnavailable as exc:
            self.refuse(conn, ErrorCode.RELEASED, str(exc))
            return None
        with self._lock:
            reg.batches += 1
        batch.callback(self._ended, reg)
        batch.enter_context(self._pump.active(reg.agent))  # its READs need our progress
        try:
            send_message(conn, encode_op(GO))
        except BaseException:
            batch.close()
            raise
        return batch

    def _ended(self, reg: _Registration) -> None:
        with self._lock:
            reg.batches -= 1
