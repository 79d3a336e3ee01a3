"""The reader side of the NIXL backend (`transport.backend.ReaderBackend`): register the
destination, READ chunks one-sided from a holder, bound every READ by the fetch's deadline
and rate floor, verify, commit.

    reader = NixlReader()                      # the client's: one NIXL agent
    channel = reader.open(f, source, None)     # f: the round's FetchState (dest, deadline, ...)
    for outcome in channel.read(chunks): ...   # one ChunkOutcome per chunk, typed
    channel.close(); reader.close()

`read` connects on first use (`FetchState.connect`, then `transport.nixl.protocol`: request
with the fetch's read token → offer), then per batch of up to `BATCH_BYTES`: `begin` → `go`,
one NIXL READ of the batch's segments straight into the destination's memory, `end`. NIXL
has no deadline of its own (a READ from a SIGSTOPped holder over TCP stays in progress for
ever), so the READ's state is polled with a bounded sleep and the handle released (which
aborts it) at the earlier of the fetch's deadline and the batch's rate-floor deadline
(`GRACE` plus its bytes at the fetch's `rate_floor`), or as soon as the fetch is aborted. A
holder that dies mid-READ makes NIXL raise within a fraction of a second. A channel whose
READ failed or was aborted drops the holder's agent (`remove_remote_agent` disconnects it),
so nothing it sends late lands in the destination, and answers FAILED from then on.

Each chunk of a finished READ is checked against the manifest by the fetch's
`ChunkVerifier` (`transport.verification`, the one check every backend runs) before it is
committed to the destination, so a reader that fetched over NIXL serves pipelined readers
over its own TCP port as one that fetched over TCP does. As every `Channel`, `read` yields
one typed `transport.outcome.ChunkOutcome` per chunk, in order, and ends after the first
that is not DONE.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from tensorhub.errors import DeadlineExceeded, SlowHolder, TensorHubError, TransportError
from transport.backend import TransportKind
from transport.fetch_state import FetchState
from transport.frames import recv_message, send_message
from transport.nixl.holder import new_agent
from transport.nixl.protocol import (
    BEGIN,
    END,
    GO,
    MAX_OFFER_BYTES,
    MAX_REQUEST_BYTES,
    NixlOffer,
    NixlRequest,
    decode_offer,
    decode_op,
    encode_op,
    encode_request,
)
from transport.outcome import ChunkOutcome, ChunkStatus
from transport.planner import Source
from transport.staging import StagingBuffer
from transport.store import HeldVersion
from transport.verification import HostBytes
from transport.wire import Refusal

BATCH_BYTES = 64 * 1024 * 1024  # bytes per begin/end bracket: one control round trip each
READ_BYTES = 4 * 1024 * 1024  # bytes per READ (at least one chunk): what is committed at once
WINDOW = 2  # READs in flight at once in a bracket: the next is on the wire while one is checked
GRACE = 1.0  # seconds a batch may take beyond its bytes at the rate floor (connection setup)
POLL_MIN, POLL_MAX = 50e-6, 2e-3  # seconds between looks at a READ's state (doubling)


class NixlReader:
    """The reader side of NIXL for one client: one NIXL agent that reads from holders.
    Destinations are registered once however many channels write into them; holders'
    agents are loaded once however many channels read from them. Thread-safe; each
    channel is used by one thread at a time."""

    kind = TransportKind.NIXL

    def __init__(self) -> None:
        self._agent = new_agent("reader")
        self._lock = threading.Lock()
        self._dests: dict[int, tuple[Any, int]] = {}  # id(dest) -> (reg descs, channels)
        self._remotes: dict[str, int] = {}  # holder agent -> channels using it

    @property
    def agent(self) -> Any:
        """The NIXL agent (`nixl_agent`)."""
        return self._agent

    def open(self, f: FetchState, source: Source, staging: StagingBuffer | None) -> NixlChannel:
        """A channel to the holder whose NIXL control port is `source`'s host:port, for
        reading `f`'s version into `f.dest` (host memory: `staging` is not used)."""
        return NixlChannel(self, f, source)

    def close(self) -> None:
        """Deregister every destination (channels must be closed first)."""
        with self._lock:
            dests, self._dests = list(self._dests.values()), {}
        for descs, _ in dests:
            if descs is not None:
                with contextlib.suppress(Exception):
                    self._agent.deregister_memory(descs)

    # -- shared registrations ------------------------------------------------------------

    def _register(self, dest: HeldVersion) -> None:
        with self._lock:
            descs, users = self._dests.get(id(dest), (None, 0))
            if not users:
                tensors = [t for t in dest.tensors.values() if t.numel()]
                try:
                    descs = self._agent.register_memory(tensors) if tensors else None
                except Exception as exc:
                    raise TransportError(f"NIXL cannot register the destination: {exc!r}") from exc
            self._dests[id(dest)] = (descs, users + 1)

    def _unregister(self, dest: HeldVersion) -> None:
        with self._lock:
            descs, users = self._dests.get(id(dest), (None, 0))
            if users > 1:
                self._dests[id(dest)] = (descs, users - 1)
                return
            self._dests.pop(id(dest), None)
        if descs is not None:
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(descs)

    def _load_remote(self, offer: NixlOffer) -> str:
        with self._lock:
            try:
                loaded = self._agent.add_remote_agent(offer.metadata)
            except Exception as exc:
                raise TransportError(f"NIXL cannot load the holder's metadata: {exc!r}") from exc
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != offer.agent:
                why = f"holder offered agent {offer.agent!r}, its metadata names {name!r}"
                raise TransportError(why)
            self._remotes[name] = self._remotes.get(name, 0) + 1
            # Start UCX's wire-up now (it does not block): the first READ need not wait
            # for it, and over cma a holder that freezes later can still be read.
            with contextlib.suppress(Exception):
                self._agent.make_connection(name)
            return name

    def _drop_remote(self, name: str, *, now: bool = False) -> None:
        """One channel less uses `name`; the agent is dropped (disconnected) when none
        does, or at once when `now` (its READ failed: nothing late may land)."""
        with self._lock:
            users = self._remotes.get(name, 0) - 1
            if users > 0 and not now:
                self._remotes[name] = users
                return
            self._remotes.pop(name, None)
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(name)


class NixlChannel:
    """One worker's channel to one holder for fetch `f` (see the module docstring)."""

    def __init__(self, reader: NixlReader, f: FetchState, source: Source) -> None:
        self._reader, self._agent = reader, reader.agent
        self._f, self._source, self._dest = f, source, f.dest
        self._sock: socket.socket | None = None
        self._remote: str | None = None
        self._regions: tuple[tuple[int, int], ...] = ()
        self._registered = False
        self._broken: BaseException | Refusal | None = None  # why later reads cannot run

    def read(self, chunks: Sequence[int]) -> Iterator[ChunkOutcome]:
        """Read `chunks` of the version into the destination, each checked against the
        manifest and committed: one outcome per chunk, in order, ending after the first
        that is not DONE. Nothing raises but a caller's bug."""
        todo = list(chunks)
        while todo:
            if self._broken is not None:
                yield self._refused(todo[0], self._broken)
                return
            try:
                refusal = self._connect()
            except (TensorHubError, OSError) as exc:
                self._fail(exc)
                continue
            if refusal is not None:
                yield ChunkOutcome.refused(todo[0], refusal)
                return
            batch, todo = self._next_batch(todo)
            for out in self._read_batch(batch):
                yield out
                if out.status is not ChunkStatus.DONE:
                    return

    def close(self) -> None:
        """Leave the holder (its channel closes; its agent is dropped when no other
        channel of this reader uses it) and release the destination's registration."""
        if self._sock is not None:
            sock, self._sock = self._sock, None
            self._forget(sock)
        if self._remote is not None:
            self._reader._drop_remote(self._remote, now=self._broken is not None)
            self._remote = None
        if self._registered:
            self._reader._unregister(self._dest)
            self._registered = False
        if self._broken is None:
            self._broken = TransportError("NIXL channel closed")

    # -- steps ---------------------------------------------------------------------------

    def _forget(self, sock: socket.socket) -> None:
        """Close a control connection `FetchState.connect` opened (the round no longer
        needs to cut it)."""
        with self._f.lock:
            self._f.socks.discard(sock)
        with contextlib.suppress(OSError):
            sock.close()

    def _fail(self, why: BaseException | Refusal) -> None:
        """This channel is done for: later reads answer with `why` (a refusal keeps its
        code: RELEASED stays RELEASED)."""
        self._broken = why
        self.close()
        self._broken = why

    @staticmethod
    def _refused(index: int, why: BaseException | Refusal) -> ChunkOutcome:
        if isinstance(why, Refusal):
            return ChunkOutcome.refused(index, why)
        return ChunkOutcome.failed(index, why)

    def _arm(self, sock: socket.socket) -> bool:
        """Bound the next receive on `sock` by the stall timeout and the deadline; whether
        the deadline is the nearer (a timeout then means the deadline passed)."""
        f = self._f
        left = f.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("NIXL read: the fetch's deadline passed")
        sock.settimeout(min(f.stall, left))
        return left <= f.stall

    def _connect(self) -> Refusal | None:
        """Connect, send the request, load the offer; a refusal is returned, not raised."""
        if self._sock is not None:
            return None
        f = self._f
        if self._dest.on_cuda:
            raise TransportError("the NIXL reader writes host memory only (for now)")
        sock = f.connect(self._source)  # bounded by the stall timeout and the deadline
        try:
            req = NixlRequest(f.tenant, f.model, f.version, f.layout.digest, f.token())
            send_message(sock, encode_request(req))
            self._arm(sock)
            answer = decode_offer(recv_message(sock, MAX_OFFER_BYTES))
        except BaseException:
            self._forget(sock)
            raise
        if isinstance(answer, Refusal):
            self._forget(sock)
            return answer
        specs = f.layout.tensors
        if len(answer.regions) != len(specs) or any(
            n != s.nbytes for (_, n), s in zip(answer.regions, specs, strict=True)
        ):
            self._forget(sock)
            raise TransportError("holder offered regions that do not match the layout")
        self._sock, self._regions = sock, answer.regions
        self._remote = self._reader._load_remote(answer)
        self._reader._register(self._dest)
        self._registered = True
        return None

    def _next_batch(self, todo: list[int]) -> tuple[list[int], list[int]]:
        size, n = 0, 0
        while n < len(todo) and (n == 0 or size + self._payload(todo[n]) <= BATCH_BYTES):
            size += self._payload(todo[n])
            n += 1
        return todo[:n], todo[n:]

    def _payload(self, index: int) -> int:
        return self._dest.layout.payload_bytes(index)

    def _descs(self, batch: Sequence[int]) -> tuple[Any, Any]:
        """The local and remote NIXL descriptor lists of `batch`'s segments."""
        flats = self._dest.flats
        rows = [
            (flats[s.tensor].data_ptr() + s.start, self._regions[s.tensor][0] + s.start, s.length)
            for i in batch
            for s in self._dest.segments(i)
        ]
        local = np.array([(a, n, 0) for a, _, n in rows], dtype=np.uint64).reshape(-1, 3)
        remote = np.array([(b, n, 0) for _, b, n in rows], dtype=np.uint64).reshape(-1, 3)
        agent = self._agent
        return agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM")

    def _read_batch(self, batch: list[int]) -> Iterator[ChunkOutcome]:
        """One `begin` … `end` bracket over `batch`: READs of up to `READ_BYTES`, `WINDOW`
        of them in flight, each one's chunks verified and committed as soon as it is done
        (so pipelined readers can take them, and a holder lost mid-batch costs only the
        READs in flight); ends after the first outcome that is not DONE."""
        f = self._f
        start = time.monotonic()
        groups = self._groups(batch)
        floors, sent = [], 0  # each READ's rate-floor deadline, from the bracket's start
        for group in groups:
            sent += sum(self._payload(i) for i in group)
            rate = f.rate_floor
            floors.append(start + GRACE + sent / rate if rate > 0 else float("inf"))
        try:
            refusal = self._begin()
        except (TensorHubError, OSError) as exc:
            self._fail(exc)
            yield ChunkOutcome.failed(batch[0], exc)
            return
        if refusal is not None:
            self._fail(refusal)
            yield ChunkOutcome.refused(batch[0], refusal)
            return
        flight: list[tuple[list[int], Any]] = []  # (chunks, handle), oldest first
        done = 0  # groups finished
        try:
            while done < len(groups):
                while len(flight) < WINDOW and done + len(flight) < len(groups):
                    group = groups[done + len(flight)]
                    flight.append((group, self._post(group)))
                group, handle = flight[0]
                self._wait(handle, f.deadline, floors[done])
                flight.pop(0)
                self._release(handle)
                done += 1
                for index in group:
                    out = self._verify(index)
                    if out.status is not ChunkStatus.DONE:
                        rest = [i for g in groups[done:] for i in g]
                        f.discard([*group[group.index(index) + 1 :], *rest])
                    yield out
                    if out.status is not ChunkStatus.DONE:
                        return
        except (TensorHubError, OSError) as exc:
            posted = [i for g, _ in flight for i in g]
            with f.lock:  # a READ posted may have landed bytes: a later copy refetches them
                f.stats.touched.update(posted)
            self._fail(exc)
            yield ChunkOutcome.failed(groups[done][0], exc)
        finally:
            for _, handle in flight:
                self._release(handle)
            if self._sock is not None:
                self._end()

    def _groups(self, batch: list[int]) -> list[list[int]]:
        """`batch` cut into READs of at most `READ_BYTES` (at least one chunk each)."""
        groups: list[list[int]] = []
        size = 0
        for index in batch:
            n = self._payload(index)
            if not groups or size + n > READ_BYTES:
                groups.append([])
                size = 0
            groups[-1].append(index)
            size += n
        return groups

    def _begin(self) -> Refusal | None:
        assert self._sock is not None
        send_message(self._sock, encode_op(BEGIN, self._f.token()))
        by_deadline = self._arm(self._sock)
        try:
            answer = decode_op(recv_message(self._sock, MAX_REQUEST_BYTES))
        except TimeoutError as exc:
            if by_deadline:
                why = "NIXL read: the holder did not answer by the deadline"
                raise DeadlineExceeded(why) from exc
            why = f"NIXL read: the holder did not answer within {self._f.stall}s"
            raise TransportError(why) from exc
        if isinstance(answer, Refusal):
            return answer
        if answer.name != GO:
            raise TransportError(f"NIXL holder answered {answer.name!r} to begin")
        return None

    def _end(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                send_message(self._sock, encode_op(END))

    def _post(self, group: Sequence[int]) -> Any:
        """Start one READ of `group`'s segments; its handle."""
        agent = self._agent
        try:
            local, remote = self._descs(group)
            handle = agent.initialize_xfer("READ", local, remote, self._remote)
        except Exception as exc:
            raise TransportError(f"NIXL cannot prepare the READ: {exc!r}") from exc
        try:
            state = agent.transfer(handle)
        except Exception as exc:  # nixlRemoteDisconnectError and NIXL's other errors
            self._release(handle)
            raise TransportError(f"NIXL READ failed: {type(exc).__name__}: {exc}") from exc
        if state not in ("PROC", "DONE"):
            self._release(handle)
            raise TransportError(f"NIXL READ ended in state {state}")
        return handle

    def _wait(self, handle: Any, deadline: float, floor: float) -> None:
        """Poll a READ (which progresses this agent) until it is done; at the deadline (or
        the rate floor's), or once the fetch is aborted, raise: the caller releases the
        handle, which aborts the READ."""
        agent = self._agent
        wait = POLL_MIN
        try:
            state = agent.check_xfer_state(handle)
            while state == "PROC":
                now = time.monotonic()
                if now >= min(deadline, floor):
                    if floor < deadline:
                        raise SlowHolder("NIXL read: the holder is below the rate floor")
                    raise DeadlineExceeded("NIXL read: the fetch's deadline passed mid-READ")
                if self._f.aborted:
                    raise TransportError("NIXL read: the fetch ended mid-READ")
                time.sleep(min(wait, min(deadline, floor) - now))
                wait = min(wait * 2, POLL_MAX)
                state = agent.check_xfer_state(handle)
        except (SlowHolder, DeadlineExceeded, TransportError):
            raise
        except Exception as exc:  # nixlRemoteDisconnectError and NIXL's other errors
            raise TransportError(f"NIXL READ failed: {type(exc).__name__}: {exc}") from exc
        if state != "DONE":
            raise TransportError(f"NIXL READ ended in state {state}")

    @staticmethod
    def _release(handle: Any) -> None:
        """Free a READ's handle (aborting it if it still runs); one that cannot be aborted
        stays NIXL's, and the channel drops the holder's agent on failure."""
        with contextlib.suppress(Exception):
            handle.release()

    def _transfer(self, batch: Sequence[int], deadline: float, floor: float) -> None:
        """One READ of `batch` to completion, outside any bracket (tests: a hostile reader
        that kept a holder's metadata). Raises what went wrong."""
        handle = self._post(batch)
        try:
            self._wait(handle, deadline, floor)
        finally:
            self._release(handle)

    def _verify(self, index: int) -> ChunkOutcome:
        """Chunk `index`, now in the destination: committed if the fetch's verifier finds
        it is what was published (`transport.verification`), else CORRUPT."""
        f = self._f
        got = HostBytes(self._dest.sink_views(index))  # read in place: hashed where it landed
        bad = f.verify.check(index, got, via="read over NIXL")
        if bad is not None:
            f.discard([index])
            return ChunkOutcome(index, ChunkStatus.CORRUPT, bad)
        self._dest.commit(index, got.xxh3())
        return ChunkOutcome(index, ChunkStatus.DONE, nbytes=self._payload(index), complete=True)
