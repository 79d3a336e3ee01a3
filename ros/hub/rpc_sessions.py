"""Session handlers: a session is an etcd lease, kept alive over a stream any replica serves.

They depend on `SessionHub`, the part of the replica they use, not on the whole
`ros.hub.state.HubState`, which provides it; the leases and session marks are asked of
`consistency.sessions.SessionRecords`, the shared keepalive stream and the batched marks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from consistency import Session
from consistency.keepalive import LeaseKeeper
from consistency.sessions import SessionRecords
from ros.hub.call import MAX_CALL_SECONDS, AioContext, CallContext
from ros.hub.limits import StreamLimits
from ros.hub.rpc import Runs, streaming, unary, unary_async
from ros.hub.session_marks import MarkJob, SessionMarks
from ros.hub.tenants import Tenant, TenantStore
from ros.metrics import HUB_SESSIONS, HUB_SESSIONS_OPENED
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument, TensorHubError
from tensorhub.lru import SizedLru

log = logging.getLogger(__name__)

MAX_SESSION_TTL = 300
RENEW_SECONDS = 10.0  # deadline of one renewal on the shared etcd keepalive stream


class SessionHub(Runs, Protocol):
    """What the session handlers use of a replica, besides running calls (`Runs`): the
    session records, the batched session marks, the shared keepalive stream, the sessions
    this replica opened (their owner known without a read), the tenants' read keys, the
    stream limits, and the worker pool a refused session's revocation runs on."""

    sessions: SessionRecords
    session_marks: SessionMarks
    leases: LeaseKeeper
    opened_sessions: SizedLru[int, str]
    tenants: TenantStore
    streams: StreamLimits
    workers: ThreadPoolExecutor

    def timeout(self, context: CallContext) -> float: ...


class SessionRPCs:
    """Session handlers: a session is an etcd lease, kept alive over a stream any replica serves."""

    def __init__(self, hub: SessionHub) -> None:
        self.hub = hub

    @unary_async
    async def OpenSession(
        self, request: pb.OpenSessionRequest, call: CallContext
    ) -> pb.OpenSessionResponse:
        """Grant a lease (in a worker) and mark it as the caller's within its session quota,
        in a batch with every other session of the tenant opening on this replica at that
        moment (`ros.hub.session_marks`), waiting for it without holding a worker."""
        tenant = call.tenant()
        timeout = self.hub.timeout(call)
        ttl = request.ttl_seconds or 10
        if not 1 <= ttl <= MAX_SESSION_TTL:
            raise InvalidArgument(f"session TTL must be 1..{MAX_SESSION_TTL} s, got {ttl}")
        session = await self.hub.blocking(self._grant, ttl, deadline_of=call)
        try:
            revision = await self.hub.session_marks.mark(
                MarkJob(tenant, session.id, time.monotonic() + timeout)
            )
        except BaseException:  # refused, failed or cancelled: the lease goes at once
            asyncio.get_running_loop().run_in_executor(
                self.hub.workers, self._revoke_quietly, session.id
            )
            raise
        HUB_SESSIONS_OPENED.inc()
        self.hub.opened_sessions.put(session.id, tenant.name)
        return pb.OpenSessionResponse(
            session_id=session.id,
            ttl_seconds=session.ttl,
            read_key=self.hub.tenants.signing_key(tenant).key,  # deprecated: for older SDKs
            revision=revision,
            read_keys=self._read_keys_pb(tenant),
        )

    def _grant(self, ttl: int) -> Session:
        """A lease of `ttl` seconds that nothing renews yet (its owner will, by KeepAlive)."""
        return self.hub.sessions.grant(ttl)

    def _read_keys_pb(self, tenant: Tenant) -> list[pb.ReadKey]:
        """The tenant's read keys a holder accepts now, for a live session of the tenant
        (OpenSession, every KeepAlive answer): that is how holders follow rotation."""
        return [pb.ReadKey(id=k.id, key=k.key) for k in self.hub.tenants.read_keys(tenant)]

    def _revoke_quietly(self, session_id: int) -> None:
        try:
            self.hub.sessions.revoke(session_id, timeout=5.0)
        except TensorHubError as exc:  # it expires within its TTL anyway
            log.info("could not revoke refused session %x: %s", session_id, exc)

    @streaming
    async def KeepAlive(
        self, requests: AsyncIterator[pb.KeepAliveRequest], context: AioContext
    ) -> AsyncGenerator[pb.KeepAliveResponse, None]:
        """Renew sessions as their owner asks, as a coroutine: each renewal goes over the
        replica's one shared etcd keepalive stream (`consistency.keepalive`), so a stream
        costs no thread and no etcd stream of its own. The first renewal of each session id
        checks that it is one of the caller's sessions; each answer that finds the lease alive
        carries the tenant's current read keys (`ros.tokens`)."""
        tenant = CallContext.of(context).tenant()
        owned: set[int] = set()
        with self.hub.streams.stream("keepalive", tenant.name):
            HUB_SESSIONS.inc()
            try:
                async for request in requests:
                    if request.session_id not in owned:
                        if self.hub.opened_sessions.get(request.session_id) != tenant.name:
                            await self.hub.blocking(
                                self.hub.sessions.own, tenant.name, request.session_id,
                                MAX_CALL_SECONDS,
                            )  # fmt: skip
                        owned.add(request.session_id)
                    ttl = await asyncio.wrap_future(
                        self.hub.leases.renew(request.session_id, RENEW_SECONDS)
                    )
                    response = pb.KeepAliveResponse(session_id=request.session_id, ttl_seconds=ttl)
                    if ttl > 0:  # keys only under a live session of the caller's own
                        response.read_keys.extend(self._read_keys_pb(tenant))
                    yield response
            finally:
                HUB_SESSIONS.dec()

    @unary
    def CloseSession(
        self, request: pb.CloseSessionRequest, context: CallContext
    ) -> pb.CloseSessionResponse:
        tenant = context.tenant()
        timeout = self.hub.timeout(context)
        self.hub.sessions.own(tenant.name, request.session_id, timeout)
        self.hub.sessions.revoke(request.session_id, timeout=timeout)
        return pb.CloseSessionResponse()
