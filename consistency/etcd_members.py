"""The etcd client's members and how one call reaches them: a gRPC channel per member
(TLS when the credentials carry it, etcd auth's token interceptor when they carry a user),
the member to talk to now (a failed one is passed over for `_SKIP_FAILED_FOR`), and a call
retried to its deadline across members, sent once more when etcd refused its token.

Apart from the client's calls (`consistency.etcd`: KV, leases, maintenance) because this is
its connection: what a call goes over and how it fails over, the same for every call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
from etcd3 import etcdrpc

from consistency.credentials import EtcdCredentials
from consistency.etcd_auth import Token, TokenInterceptor
from consistency.etcd_errors import translate
from consistency.retry import RetryPolicy, is_retryable
from tensorhub.errors import DeadlineExceeded

T = TypeVar("T")

DEFAULT_TIMEOUT = 5.0
_SKIP_FAILED_FOR = 1.0  # seconds a failed member is passed over before it is tried again


class Endpoint:
    """One member's gRPC channel and its stubs; `failed_at`: when a call to it last failed
    (`EtcdMembers.mark_failed`)."""

    def __init__(
        self, target: str, credentials: EtcdCredentials | None = None, token: Token | None = None
    ) -> None:
        self.target = target
        options = [
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        if credentials is not None and credentials.tls:
            tls = grpc.ssl_channel_credentials(
                root_certificates=credentials.ca,
                private_key=credentials.key,
                certificate_chain=credentials.cert,
            )
            self._raw = grpc.secure_channel(target, tls, options=options)
        else:
            self._raw = grpc.insecure_channel(target, options=options)
        self.authenticator = etcdrpc.AuthStub(self._raw)  # Authenticate goes without a token
        self.channel: grpc.Channel = self._raw
        if token is not None:
            interceptor = TokenInterceptor(token, self.authenticator, DEFAULT_TIMEOUT)
            self.channel = grpc.intercept_channel(self._raw, interceptor)
        self.auth = etcdrpc.AuthStub(self.channel)
        self.kv = etcdrpc.KVStub(self.channel)
        self.lease = etcdrpc.LeaseStub(self.channel)
        self.watch = etcdrpc.WatchStub(self.channel)
        self.maintenance = etcdrpc.MaintenanceStub(self.channel)
        self.failed_at = 0.0


class EtcdMembers:
    """Which member `consistency.etcd.Etcd` talks to and how one call goes (`member`,
    `mark_failed`, `call`); `Etcd` derives from it and sets these attributes in its
    `__init__`."""

    timeout: float
    policy: RetryPolicy
    _token: Token | None
    _members: list[Endpoint]
    _lock: threading.Lock
    _current: int

    # -- member selection ------------------------------------------------------------------

    def member(self) -> Endpoint:
        """The member to talk to now: the current one unless it failed very recently."""
        with self._lock:
            now = time.monotonic()
            for step in range(len(self._members)):
                index = (self._current + step) % len(self._members)
                if now - self._members[index].failed_at >= _SKIP_FAILED_FOR:
                    self._current = index
                    return self._members[index]
            return self._members[self._current]

    def mark_failed(self, member: Endpoint) -> None:
        """Pass over `member` for a moment and move on to the next one."""
        with self._lock:
            member.failed_at = time.monotonic()
            if self._members[self._current] is member:
                self._current = (self._current + 1) % len(self._members)

    def call(self, fn: Callable[[Endpoint, float], T], *, timeout: float | None = None) -> T:
        """Run `fn(member, attempt_timeout)`, retrying transient errors until the deadline."""
        budget = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        try:
            for attempt in self.policy.retrying(deadline):
                with attempt:
                    member = self.member()
                    remaining = max(deadline - time.monotonic(), 0.01)
                    try:
                        # Half the budget per attempt, so a hung member leaves time for another.
                        return self._with_token(fn, member, min(remaining, max(budget / 2, 0.5)))
                    except grpc.RpcError as exc:
                        if is_retryable(exc):
                            self.mark_failed(member)
                        raise
        except grpc.RpcError as exc:
            raise translate(exc, budget) from exc
        raise DeadlineExceeded(f"etcd call did not complete within {budget:.1f}s")

    def _with_token(self, fn: Callable[[Endpoint, float], T], member: Endpoint, t: float) -> T:
        """`fn(member, t)`, sent once more if etcd refused its token (`Token.resend_refused`)."""
        if self._token is None:
            return fn(member, t)
        return self._token.resend_refused(lambda: fn(member, t), member.authenticator, t)
