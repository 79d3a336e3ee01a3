"""The client's session: one object that owns its lease, the keepalive, the recovery after a
loss, and the read keys its holder server checks tokens with (the model is etcd's
`concurrency/session.go`: the session owns its lease from grant to revoke).

A lost lease (no renewal before its TTL ran out, or a call answered `SessionExpired`) stops
the holder server from serving at once (`verify` refuses); the client then needs a new lease
and every held version re-registered under it (docs/design.md, "Sessions and leases"). One
recovery thread at a time,
started by a loss, tries `OpenSession` and then the re-registration of every held version
(`Holdings.reregister`) on `RECOVERY_POLICY` (full-jitter backoff, no deadline) until both
are done or the client closes. A version the hub refuses for good is skipped (logged) and
does not keep the others unregistered.

Closing is two calls, as etcd's "stop renewing" and "stop and revoke" are: `close()` takes
the lease under the same lock a recovery installs a new one under, so a lease is either the
client's (and `revoke()` ends it) or opened after `close()` (and the recovery ends it itself,
never renewing it); `join()` then waits for the recovery thread, bounded.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from consistency.retry import OPEN_POLICY, RECOVERY_POLICY, RetryPolicy
from ros.client.holdings import Holdings, Register
from ros.client.lease import Lease, read_keys_of
from ros.client.rpc import Rpc
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from ros.tokens import ReadKey, ReadTokenVerifier
from tensorhub.errors import InternalError, TensorHubError
from transport.store import Key

log = logging.getLogger(__name__)

RECOVERY_JOIN_TIMEOUT = 2.0  # the most close() waits for a recovery to stop (s)
DISPOSE_TIMEOUT = 1.0  # CloseSession of a lease opened after close() (s)


class Session:
    """The client's session: its current `Lease`, the read keys, and the one thread that
    recovers it after a loss. `id`, `lost`, `renewals`, `read_key(s)` and `streams_opened`
    are the current lease's."""

    def __init__(
        self,
        rpc: Rpc,
        *,
        tenant: str,
        ttl: int,
        timeout: float,
        stub: hub_pb2_grpc.TensorHubStub,
        metadata: tuple[tuple[str, str], ...],
        keepalive: RetryPolicy,
        holdings: Holdings,
        observe: Callable[[int], None],
        open_policy: RetryPolicy = OPEN_POLICY,
        recovery: RetryPolicy = RECOVERY_POLICY,
    ) -> None:
        self._rpc = rpc  # tried once per call: every loop here has its own policy
        self._tenant = tenant
        self._ttl = ttl
        self._timeout = timeout
        self._stub, self._metadata = stub, metadata  # a lease's KeepAlive stream
        self._keepalive = keepalive  # how a broken KeepAlive stream is reopened
        self._holdings = holdings
        self._observe = observe  # the revision floor: an OpenSession answer is a fact
        self._open_policy = open_policy
        self._policy = recovery
        self._register: Register | None = None
        self._tokens = ReadTokenVerifier([], tenant)  # the keys of every lease, in turn
        self._lock = threading.Lock()
        self._current: Lease | None = None
        self._closed = threading.Event()  # set by close(): cuts every backoff wait short
        self._wanted = threading.Event()  # a loss the running recovery has not seen yet
        self._thread: threading.Thread | None = None
        self._pending: set[Key] = set()  # held versions not yet re-registered
        self.failures = 0  # failed recovery attempts, all losses together
        self.recoveries = 0  # leases opened by a recovery

    # -- the lease ---------------------------------------------------------------------------

    @property
    def lease(self) -> Lease:
        """The lease in use: a recovery replaces it after a loss."""
        current = self._current
        if current is None:
            raise InternalError("the client has no session yet")
        return current

    @property
    def id(self) -> int:
        return self.lease.id

    @property
    def lost(self) -> threading.Event:
        return self.lease.lost

    @property
    def renewals(self) -> int:
        return self.lease.renewals

    @property
    def read_key(self) -> ReadKey:
        return self.lease.read_key

    @property
    def read_keys(self) -> list[ReadKey]:
        return self.lease.read_keys

    @property
    def streams_opened(self) -> int:
        return self.lease.streams_opened

    @property
    def current(self) -> Lease | None:
        """The lease in use (None before the first is open); it may be lost."""
        return self._current

    @property
    def recovering(self) -> bool:
        """Whether a recovery thread is running now."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def open(self, register: Register) -> Lease:
        """Open the client's first lease (connect; `Overloaded` and `Unavailable` tried again
        on `OPEN_POLICY`, other errors propagate). `register` re-registers a held version
        under a new lease after a loss."""
        self._register = register
        policy = self._open_policy
        deadline = policy.deadline(self._timeout)
        opened = policy.call(lambda: self._open_rpc(max(deadline - policy.clock(), 0.01)), deadline)
        lease = self._lease_of(opened)
        with self._lock:
            self._current = lease
        return lease

    def verify(self, tenant: str, model: str, version: int, token: bytes) -> bool:
        """The holder server's check of a read token: refused at once once the lease is
        lost, else checked against the tenant's current read keys."""
        current = self._current
        if current is None or current.lost.is_set():
            return False
        return self._tokens(tenant, model, version, token)

    def _open_rpc(self, timeout: float) -> pb.OpenSessionResponse:
        opened = self._rpc("OpenSession", pb.OpenSessionRequest(ttl_seconds=self._ttl), timeout)
        self._observe(int(opened.revision))
        return opened

    def _lease_of(self, opened: pb.OpenSessionResponse) -> Lease:
        """Keep `opened` alive; its keys (and every KeepAlive answer's) replace the last."""
        keys = read_keys_of(opened.read_keys)
        if not keys:
            raise InternalError("the hub sent no read keys: it is older than this SDK")
        self._tokens.update(keys)
        return Lease(
            self._stub, self._metadata, opened, on_lost=self.lost_lease, on_keys=self.keys,
            policy=self._keepalive,
        )  # fmt: skip

    def keys(self, keys: list[ReadKey]) -> None:
        """A lease's KeepAlive answer carried the current read keys (they rotate)."""
        self._tokens.update(keys)

    def lost_lease(self, lease: Lease) -> None:
        """`lease` was lost (its `on_lost`): start a recovery, unless one runs already (it
        sees this loss on its next try) or the client is closing."""
        with self._lock:
            if self._closed.is_set():
                return
            self._wanted.set()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._supervise, name="hub-session-recover", daemon=True
                )
                self._thread.start()

    # -- recovery ----------------------------------------------------------------------------

    def _supervise(self) -> None:
        while not self._closed.is_set():
            self._wanted.clear()
            try:
                self._policy.retrying(
                    None, stop=self._closed.is_set, sleep=self._closed.wait,
                    before_sleep=self._failed,
                )(self._attempt)  # fmt: skip
            except Exception as exc:  # only when closing: the policy retries everything else
                log.info("session recovery stopped by close(): %s", exc)
                return
            with self._lock:
                if self._closed.is_set():
                    return
                if not self._wanted.is_set():  # done: a later loss starts a new thread
                    self._thread = None
                    return

    def _failed(self, exc: BaseException, delay: float) -> None:
        self.failures += 1
        log.warning("session recovery failed (%s); trying again in %.2fs", exc, delay)

    def _attempt(self) -> None:
        """One try: a new lease if the current one is lost, then the versions not yet
        re-registered under it. Raises whatever failed; the policy tries again."""
        current = self._current
        if current is None or current.lost.is_set():
            lease = self._install(self._open_rpc(self._timeout))
            if lease is None:
                return  # closed meanwhile: disposed of
            log.info("session %x replaces lost session %x", lease.id, getattr(current, "id", 0))
        if self._pending:
            if self._register is None:
                raise InternalError("a session recovered before it was opened")
            self._holdings.reregister(self._pending, self._register)

    def _install(self, opened: pb.OpenSessionResponse) -> Lease | None:
        """Make `opened` the client's lease, unless close() came first: then end it."""
        old: Lease | None = None
        with self._lock:
            installed = not self._closed.is_set()
            if installed:
                old, self._current = self._current, self._lease_of(opened)
                self._pending = {h.key for h in self._holdings.held()}
                self.recoveries += 1
            lease = self._current
        if not installed:
            self._dispose(int(opened.session_id))
            return None
        if old is not None:
            old.stop()  # lost: its thread is ending (outside the lock: it may call lost())
        return lease

    def _dispose(self, session_id: int) -> None:
        """End a lease opened after close(): never renewed, revoked if the hub still
        answers, else it expires within its TTL."""
        try:
            self._close_rpc(session_id, DISPOSE_TIMEOUT)
        except Exception as exc:  # a TensorHubError, or the channel closed by close()
            log.info("session %x opened while closing: %s; it expires within its TTL",
                     session_id, exc)  # fmt: skip

    def _close_rpc(self, session_id: int, timeout: float) -> None:
        """CloseSession: the hub revokes the lease, and every record on it goes at once."""
        self._rpc("CloseSession", pb.CloseSessionRequest(session_id=session_id), timeout)

    # -- closing -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop recovering: no lease is installed after this (the current one still renews
        until `revoke`)."""
        with self._lock:
            self._closed.set()
            if self._current is None:
                raise InternalError("closing a client that never opened a session")

    def revoke(self, timeout: float) -> None:
        """Stop renewing the lease and have the hub revoke it, waiting at most `timeout` (a
        stalled hub leaves it to expire within its TTL)."""
        lease = self.lease
        lease.stop()
        try:
            self._close_rpc(lease.id, timeout)
        except TensorHubError as exc:
            log.info("closing: session not revoked (%s); it expires within its TTL", exc)

    def join(self, timeout: float = RECOVERY_JOIN_TIMEOUT) -> bool:
        """Wait up to `timeout` for the recovery thread to stop; whether it has."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True
