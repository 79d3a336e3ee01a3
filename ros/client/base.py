"""What the SDK's `Hub` is built on: the channel and session, the revision floor, and the
holder server that serves every version this client publishes or fetches."""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from consistency.floor import RevisionFloor
from consistency.retry import DEFAULT_POLICY, RetryPolicy
from ros.client.advertise import served_endpoints, stop_served
from ros.client.backoff import retry_overloaded
from ros.client.channel import open_channel, parse_address
from ros.client.handles import DEFAULT_RELEASE_TIMEOUT
from ros.client.holdings import Holdings
from ros.client.hooks import PRODUCTION, ClientHooks
from ros.client.manifest_cache import CachedManifest, ManifestCache
from ros.client.recovery import RECOVERY_JOIN_TIMEOUT, Sessions
from ros.client.retention import Retention, SpillStats
from ros.client.rpc import HubRpc, Rpc
from ros.client.session import ClientSession, read_keys_of
from ros.client.watch import HubWatch
from ros.manifest_check import check_received
from ros.metrics import SDK_BYTES_SERVED
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from ros.tokens import ReadTokenVerifier
from tensorhub.endpoints import format_endpoint
from tensorhub.errors import (
    InternalError,
    InvalidArgument,
    TensorHubError,
)
from tensorhub.names import validate_name
from transport.server import HolderServer
from transport.tls import TlsConfig
from transport.topology import Topology

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 10.0
CLOSE_SESSION_TIMEOUT = 1.0  # the most close() waits for the hub to revoke the session
T = TypeVar("T")


def default_holder_name() -> str:
    """`{host}-{pid}-{random}`, squeezed into the name pattern."""
    host = re.sub(r"[^a-z0-9._-]", "-", socket.gethostname().lower()).strip("-.")[:40] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


class ClientBase:
    """Connection state and plumbing shared by the publish and fetch sides."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        tenant: str,
        token: str,
        topology: Mapping[str, str] | None = None,
        listen: str = "127.0.0.1:0",
        advertise: str | None = None,
        name: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        session_ttl: int = 10,
        tls: TlsConfig | None = None,
        hooks: ClientHooks = PRODUCTION,
        spill_budget: int | None = None,
        retry: RetryPolicy = DEFAULT_POLICY,
    ) -> None:
        addresses = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        self._hooks = hooks  # fault injection (chaos, tests) enters here only: ros.client.hooks
        self.tenant = validate_name(tenant, "tenant")
        self.holder_name = validate_name(name or default_holder_name(), "holder")
        self.topology = Topology(**dict(topology or {}))
        self.timeout = timeout
        self.retry = retry  # how reads and watches are tried again (`consistency.retry`)
        self._listen = parse_address(listen, allow_zero=True)
        if advertise is not None:
            format_endpoint(advertise, 1)  # a host no reader could use fails here, not later
        self._advertise = advertise
        # The tenant travels on every call: the hub refuses a token of another tenant.
        self._metadata = (("authorization", f"Bearer {token}"), ("tensorhub-tenant", self.tenant))
        self._tls = tls
        self._channel = open_channel(addresses, tls=tls)
        self._stub = hub_pb2_grpc.TensorHubStub(self._channel)  # type: ignore[no-untyped-call]
        # every unary hub call, typed by method (`ros.client.rpc`)
        self._rpc: Rpc = HubRpc(self._stub, self._metadata, lambda: self.timeout, self._current)
        self.floor: RevisionFloor = hooks.floor()
        self._lock = threading.RLock()
        self.holdings = Holdings(self.tenant)  # what this client serves: the one owner of it
        self._server: HolderServer | None = None
        self._manifests = ManifestCache()  # by (model, version, shard): they never change
        self._retention = Retention(spill_budget)  # bytes of host spills (None: the default)
        self._session_ttl = session_ttl
        self._closed = False
        self._sessions = Sessions(self, self.holdings)  # the session, and its recovery
        try:
            self._sessions.open_first()
        except BaseException:  # refused at connect (a bad token, another tenant's token)
            self._channel.close()
            raise

    @property
    def session(self) -> ClientSession:
        """The session in use: a recovery replaces it after a loss (`ros.client.recovery`)."""
        current = self._sessions.current
        if current is None:
            raise InternalError("the client has no session yet")
        return current

    @property
    def recovery(self) -> Sessions:
        """The owner of the session and its recovery: `recovering`, `failures`, `recoveries`."""
        return self._sessions

    # -- plumbing --------------------------------------------------------------------------

    def _current(self) -> ClientSession | None:
        return self._sessions.current

    def _fresh(
        self, call: Callable[[float], T], revision_of: Callable[[T], int], timeout: float
    ) -> T:
        """A read whose answer is not older than our revision floor, tried again on the
        client's `RetryPolicy` until the deadline: a `StaleRead` from a lagging replica, or
        one unreachable or overloaded (`consistency.retry`). Before, only a stale answer was
        read again, on a fixed 50 ms loop."""
        deadline = self.retry.deadline(timeout)

        def read() -> T:
            answer = call(max(deadline - self.retry.clock(), 0.01))
            self.floor.accept(revision_of(answer))
            return answer

        return self.retry.call(read, deadline)

    def _open_session_rpc(self) -> pb.OpenSessionResponse:
        """OpenSession (an `Overloaded` refusal waited out); the session is not kept alive
        until `_session_of` makes a `ClientSession` of it."""
        request = pb.OpenSessionRequest(ttl_seconds=self._session_ttl)
        opened: pb.OpenSessionResponse = retry_overloaded(
            lambda: self._rpc("OpenSession", request), self.timeout
        )
        self.floor.observe(opened.revision)
        return opened

    def _close_session_rpc(self, session_id: int, timeout: float) -> None:
        """CloseSession: the hub revokes the lease, and every record on it goes at once."""
        self._rpc("CloseSession", pb.CloseSessionRequest(session_id=session_id), timeout)

    def _session_of(self, opened: pb.OpenSessionResponse) -> ClientSession:
        """Keep `opened` alive: a `ClientSession` whose loss starts a recovery."""
        keys = read_keys_of(opened.read_keys)
        if not keys:
            raise InternalError("the hub sent no read keys: it is older than this SDK")
        # One verifier for the client's life: each session's keys (OpenSession, then every
        # KeepAlive answer) replace the last, so the holder server follows rotation.
        verifier: ReadTokenVerifier | None = getattr(self, "_read_tokens", None)
        if verifier is None:
            self._read_tokens = ReadTokenVerifier(keys, self.tenant)
        else:
            verifier.update(keys)
        return ClientSession(
            self._stub, self._metadata, opened, on_lost=self._sessions.lost,
            on_keys=self._read_tokens.update,
            policy=self.retry,  # how its stream is reopened, as every read is tried again
        )  # fmt: skip

    def _verifier(self, tenant: str, model: str, version: int, token: bytes) -> bool:
        session = self.session
        if session.lost.is_set():
            return False  # a client that lost its session stops serving at once
        return self._read_tokens(tenant, model, version, token)

    def _holder_server(self) -> HolderServer:
        with self._lock:
            if self._server is None:
                host, port = self._listen
                self._server = HolderServer(
                    self.holdings.store, self._verifier, host, port, tls=self._tls,
                    on_served=SDK_BYTES_SERVED.inc, send=self._hooks.send,
                ).start()  # fmt: skip
            return self._server

    def _endpoint(self) -> str:
        host, port = self._holder_server().address
        if self._advertise:
            host = self._advertise
        elif host in ("0.0.0.0", "::"):
            host = socket.gethostbyname(socket.gethostname())
        return format_endpoint(host, port)  # an IPv6 host bracketed, as readers parse it

    def _holder_pb(self, complete: bool, fence: int = 0, shard: int | None = None) -> pb.Holder:
        labels = {k: v for k, v in vars(self.topology).items() if v}
        return pb.Holder(
            name=self.holder_name,
            endpoints=served_endpoints(  # tcp, and rdma where this machine serves it
                self,
                self._endpoint(),
                self._holder_server().store,
                self._verifier,
                self._listen[0],
                tls=self._tls is not None,
            ),
            topology=labels,
            state=pb.COMPLETE if complete else pb.PARTIAL,
            session_id=self.session.id,
            fence=fence,
            shard=shard,
        )

    def _register(
        self, model: str, version: int, *, complete: bool, shard: int | None = None
    ) -> int:
        return int(self._register_holder(model, version, complete=complete, shard=shard).fence)

    def _register_holder(
        self,
        model: str,
        version: int,
        *,
        complete: bool,
        shard: int | None = None,
        timeout: float | None = None,
    ) -> pb.RegisterHolderResponse:
        """Register our holder record; a PARTIAL one's answer carries its `candidates`.
        `timeout` (default: the client's) is what a fetch's deadline leaves for it."""
        request = pb.RegisterHolderRequest(
            model=model, version=version, holder=self._holder_pb(complete, shard=shard)
        )
        response: pb.RegisterHolderResponse = self._rpc("RegisterHolder", request, timeout)
        self.floor.observe(response.revision)
        return response

    def _inspect(
        self, model: str, version: int, timeout: float | None = None
    ) -> pb.InspectResponse:
        """`Inspect` with every holder: the pages followed (the first carries the manifest),
        each at least as fresh as our revision floor; the revision is the last page's."""
        budget = self.timeout if timeout is None else timeout
        request = pb.InspectRequest(model=model, version=version)
        info: pb.InspectResponse = self._fresh(
            lambda t: self._rpc("Inspect", request, t), lambda r: int(r.revision), budget
        )
        request.version, request.omit_manifest = info.version, True
        while info.next_page_token:
            request.page_token = info.next_page_token
            page: pb.InspectResponse = self._fresh(
                lambda t: self._rpc("Inspect", request, t), lambda r: int(r.revision), budget
            )
            info.holders.extend(page.holders)
            info.next_page_token, info.revision = page.next_page_token, page.revision
            info.total_holders = page.total_holders
        return info

    def _resolve(
        self,
        model: str,
        version: int,
        *,
        shard: int | None = None,
        fence: int = 0,
        timeout: float | None = None,
        manifest: bool = True,
    ) -> pb.ResolveResponse:
        """Resolve `model@version` (0: latest) for this client: its topology, fence and
        name (never among the candidates), at least as fresh as our revision floor.

        The manifest is asked for only when `manifest` and not cached (by model, version,
        shard: it never changes); the answer then always carries it, from the hub or from
        the cache (checked against the hub's digest: a mismatch asks once more in full).
        """
        cached = self._manifests.get((model, version, shard)) if version else None
        omit = cached is not None or not manifest
        request = pb.ResolveRequest(
            model=model, version=version, shard=shard, omit_manifest=omit,
            topology={k: v for k, v in vars(self.topology).items() if v},
            fence=fence, holder=self.holder_name, min_revision=self.floor.value,
        )  # fmt: skip
        budget = self.timeout if timeout is None else timeout
        answer: pb.ResolveResponse = self._fresh(
            lambda t: self._rpc("Resolve", request, t), lambda r: int(r.revision), budget
        )
        if not manifest:
            return answer
        key = (model, int(answer.version), shard)
        if answer.manifest_omitted:
            cached = self._manifests.get(key)
            if cached is not None and cached.digest == bytes(answer.manifest_digest):
                cached.fill(answer)
                return answer
            # evicted meanwhile, or not what the hub has: ask once more, with the manifest
            self._manifests.pop(key)
            request.version, request.omit_manifest = answer.version, False
            answer = self._fresh(
                lambda t: self._rpc("Resolve", request, t), lambda r: int(r.revision), budget
            )
        check_received(answer, f"{model}@{answer.version}")  # before any use, or caching
        self._manifests.put(key, CachedManifest.of(answer))
        return answer

    # -- watching ------------------------------------------------------------------------

    def watch(
        self, model: str, *, since: int | None = None, versions_only: bool = False
    ) -> HubWatch:
        """New versions and holder changes of `model` from revision `since` (default: now).

        With `versions_only`, the hub sends only new versions (and resyncs): what a rollout
        waiting for weights needs, without one message per holder change of every reader.
        Iterate it, or call `get(timeout)`; close it (or use `with`) when done.
        """
        validate_name(model, "model")
        if since is None:
            since = int(self._rpc("Latest", pb.LatestRequest(model=model)).revision) + 1
        elif since <= 0:
            raise InvalidArgument("since must be a positive revision")
        return HubWatch(
            self._stub, self._metadata, model, since, self.floor, versions_only, self.retry
        )

    # -- release and lifecycle ---------------------------------------------------------

    def _release(
        self,
        model: str,
        version: int,
        *,
        force: bool,
        timeout: float = DEFAULT_RELEASE_TIMEOUT,
        spill: str | os.PathLike[str] | None = None,
    ) -> None:
        """Delete our holder record, then refuse new reads and wait for reads in flight.

        Where the hub refuses (the last complete holder of a retained version), the version
        is spilled to host memory within the spill budget and served from there; with
        `spill`, it is written to that safetensors file and served from it. The record stays
        then, and the caller's memory is free all the same (`ros.client.retention`).
        """
        self._retention.release(self, model, version, force=force, timeout=timeout, spill=spill)

    @property
    def spills(self) -> SpillStats:
        """Host spills made, held now (versions, bytes), freed; file spills; the budget."""
        return self._retention.stats

    def close(self) -> None:
        """Stop serving, end the session (its records vanish at once), close the channel.

        The hub is waited for at most `CLOSE_SESSION_TIMEOUT` (CloseSession; a stalled hub
        leaves the session to expire within its TTL), the keepalive thread at most 2 s, and a
        recovery in progress at most `RECOVERY_JOIN_TIMEOUT` (2 s; it is stopped first, and a
        session it opens after that is ended by it, never renewed); reads in flight from our
        holder server get up to 5 s per held version.
        """
        if self._closed:
            return
        self._closed = True
        session = self._sessions.close()  # no recovery installs a session after this
        self.holdings.drop_all(5.0)
        session.stop()
        try:
            self._close_session_rpc(session.id, CLOSE_SESSION_TIMEOUT)
        except TensorHubError as exc:
            log.info("closing: session not revoked (%s); it expires within its TTL", exc)
        if self._server is not None:
            self._server.stop()
        stop_served(self)
        self._channel.close()  # also ends a recovery's call in flight
        if not self._sessions.join(RECOVERY_JOIN_TIMEOUT):
            log.warning("closing: the session recovery did not stop within %ss",
                        RECOVERY_JOIN_TIMEOUT)  # fmt: skip
