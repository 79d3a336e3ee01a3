"""Session handlers: a session is an etcd lease, kept alive over a stream any replica serves."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from consistency import Session
from ros.hub.rpc import MAX_CALL_SECONDS, HubBase, streaming, unary
from ros.metrics import HUB_SESSIONS, HUB_SESSIONS_OPENED
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument, QuotaExceeded

MAX_SESSION_TTL = 300


class SessionRPCs(HubBase):
    """Session handlers: a session is an etcd lease, kept alive over a stream any replica serves."""

    @unary
    def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.ServicerContext
    ) -> pb.OpenSessionResponse:
        tenant = self._tenant(context)
        timeout = self._timeout(context)
        ttl = request.ttl_seconds or 10
        if not 1 <= ttl <= MAX_SESSION_TTL:
            raise InvalidArgument(f"session TTL must be 1..{MAX_SESSION_TTL} s, got {ttl}")
        count = len(
            self.etcd.range(
                self.keys.sessions(tenant.name), prefix=True, keys_only=True, timeout=timeout
            ).kvs
        )
        if count >= tenant.quotas.max_sessions:
            raise QuotaExceeded(
                f"tenant {tenant.name} has {count} sessions (quota {tenant.quotas.max_sessions})"
            )
        session = Session(self.etcd, ttl=ttl, keepalive=False)
        revision = self.etcd.put(
            self.keys.session(tenant.name, session.id), b"", lease=session.id, timeout=timeout
        )
        HUB_SESSIONS_OPENED.inc()
        return pb.OpenSessionResponse(
            session_id=session.id,
            ttl_seconds=session.ttl,
            read_key=self.tenants.read_key(tenant.name),
            revision=revision,
        )

    @streaming
    def KeepAlive(
        self, requests: Iterator[pb.KeepAliveRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.KeepAliveResponse]:
        tenant = self._tenant(context)
        owned: set[int] = set()
        HUB_SESSIONS.inc()
        try:
            for request in requests:
                if request.session_id not in owned:
                    self._own_session(tenant, request.session_id, MAX_CALL_SECONDS)
                    owned.add(request.session_id)
                ttl = self.etcd.lease_keepalive(request.session_id, timeout=MAX_CALL_SECONDS)
                yield pb.KeepAliveResponse(session_id=request.session_id, ttl_seconds=ttl)
        finally:
            HUB_SESSIONS.dec()

    @unary
    def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.ServicerContext
    ) -> pb.CloseSessionResponse:
        tenant = self._tenant(context)
        timeout = self._timeout(context)
        self._own_session(tenant, request.session_id, timeout)
        self.etcd.lease_revoke(request.session_id, timeout=timeout)
        return pb.CloseSessionResponse()
