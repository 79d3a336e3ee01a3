"""A typed etcd v3 client with per-call deadlines and failover across members.

Built on the generated stubs of python3-etcd3 (`etcd3.etcdrpc`) rather than its client class:
that class has one timeout for all calls, locks a failed member out for 300 s, and its watch
thread breaks on stream errors (it calls an unimported `six`). Here every call takes a deadline,
a member that fails is skipped for a short while, and retries follow `consistency.retry`.
Reads are linearizable (never `serializable`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import grpc
from etcd3 import etcdrpc

from consistency import ops
from consistency.ops import KV, Cmp, Op
from consistency.retry import DEFAULT_POLICY, RetryPolicy, is_deadline, is_retryable
from tensorhub.errors import DeadlineExceeded, TensorHubError, Unavailable

T = TypeVar("T")

DEFAULT_TIMEOUT = 5.0
_SKIP_FAILED_FOR = 1.0  # seconds a failed member is passed over before it is tried again


class RevisionCompacted(TensorHubError):
    """A read or watch asked for a revision that etcd has already compacted."""

    code = "OUT_OF_RANGE"

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


@dataclass(frozen=True)
class RangeResult:
    """The keys a range read found, and the store revision it was served at."""

    kvs: list[KV]
    revision: int


@dataclass(frozen=True)
class TxnResult:
    """Whether a transaction's compares held, its revision, and how many attempts it took.

    `attempts > 1` means an earlier attempt may have been applied before its reply was lost,
    so a failed compare can be the caller's own write: callers check ownership then.
    """

    succeeded: bool
    revision: int
    responses: list[Any]
    attempts: int


class _Endpoint:
    def __init__(self, target: str) -> None:
        self.target = target
        self.channel = grpc.insecure_channel(
            target,
            options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ],
        )
        self.kv = etcdrpc.KVStub(self.channel)
        self.lease = etcdrpc.LeaseStub(self.channel)
        self.watch = etcdrpc.WatchStub(self.channel)
        self.maintenance = etcdrpc.MaintenanceStub(self.channel)
        self.failed_at = 0.0


class Etcd:
    """Connection to an etcd cluster given as `host:port` endpoints (one or several members)."""

    def __init__(
        self,
        endpoints: list[str] | str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        policy: RetryPolicy = DEFAULT_POLICY,
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = [e for e in endpoints.split(",") if e]
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self.endpoints = [e.removeprefix("http://") for e in endpoints]
        self.timeout = timeout
        self.policy = policy
        self._members = [_Endpoint(e) for e in self.endpoints]
        self._lock = threading.Lock()
        self._current = 0
        self._counter = itertools.count()

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        for member in self._members:
            member.channel.close()

    def __enter__(self) -> Etcd:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- member selection ------------------------------------------------------------------

    def member(self) -> _Endpoint:
        """The member to talk to now: the current one unless it failed very recently."""
        with self._lock:
            now = time.monotonic()
            for step in range(len(self._members)):
                index = (self._current + step) % len(self._members)
                if now - self._members[index].failed_at >= _SKIP_FAILED_FOR:
                    self._current = index
                    return self._members[index]
            return self._members[self._current]

    def mark_failed(self, member: _Endpoint) -> None:
        """Pass over `member` for a moment and move on to the next one."""
        with self._lock:
            member.failed_at = time.monotonic()
            if self._members[self._current] is member:
                self._current = (self._current + 1) % len(self._members)

    def call(self, fn: Callable[[_Endpoint, float], T], *, timeout: float | None = None) -> T:
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
                        return fn(member, min(remaining, max(budget / 2, 0.5)))
                    except grpc.RpcError as exc:
                        if is_retryable(exc):
                            self.mark_failed(member)
                        raise
        except grpc.RpcError as exc:
            raise _translate(exc, budget) from exc
        raise DeadlineExceeded(f"etcd call did not complete within {budget:.1f}s")

    # -- KV --------------------------------------------------------------------------------

    def get(self, key: str | bytes, *, timeout: float | None = None) -> tuple[KV | None, int]:
        """The key (or None) and the revision the read was served at."""
        result = self.range(key, timeout=timeout)
        return (result.kvs[0] if result.kvs else None), result.revision

    def range(
        self,
        key: str | bytes,
        *,
        prefix: bool = False,
        revision: int = 0,
        keys_only: bool = False,
        limit: int = 0,
        timeout: float | None = None,
    ) -> RangeResult:
        """A linearizable range read, optionally of a whole prefix or at an old revision."""
        request = etcdrpc.RangeRequest(
            key=ops.b(key), revision=revision, keys_only=keys_only, limit=limit
        )
        if prefix:
            request.range_end = ops.prefix_end(key)
        response = self.call(lambda m, t: m.kv.Range(request, timeout=t), timeout=timeout)
        return RangeResult([KV.from_pb(kv) for kv in response.kvs], int(response.header.revision))

    def txn(
        self,
        compare: list[Cmp],
        success: list[Op],
        failure: list[Op] | None = None,
        *,
        timeout: float | None = None,
    ) -> TxnResult:
        """One transaction; see `TxnResult.attempts` for what a retried write means."""
        request = ops.txn_request(compare, success, failure)
        attempts = 0

        def send(member: _Endpoint, t: float) -> Any:
            nonlocal attempts
            attempts += 1
            return member.kv.Txn(request, timeout=t)

        response = self.call(send, timeout=timeout)
        return TxnResult(
            bool(response.succeeded),
            int(response.header.revision),
            list(response.responses),
            attempts,
        )

    def put(
        self, key: str | bytes, value: str | bytes, *, lease: int = 0, timeout: float | None = None
    ) -> int:
        """Put one key; returns the revision. Retried puts are idempotent (same value)."""
        return self.txn([], [ops.put(key, value, lease)], timeout=timeout).revision

    def delete(
        self, key: str | bytes, *, prefix: bool = False, timeout: float | None = None
    ) -> int:
        """Delete a key or a prefix; returns the revision."""
        return self.txn([], [ops.delete(key, prefix=prefix)], timeout=timeout).revision

    def compact(self, revision: int, *, timeout: float | None = None) -> None:
        """Compact history up to `revision` (physical, so watches see it at once)."""
        request = etcdrpc.CompactionRequest(revision=revision, physical=True)
        self.call(lambda m, t: m.kv.Compact(request, timeout=t), timeout=timeout)

    # -- leases ----------------------------------------------------------------------------

    def lease_grant(self, ttl: int, *, timeout: float | None = None) -> tuple[int, int]:
        """Grant a lease; returns (lease id, granted TTL)."""
        request = etcdrpc.LeaseGrantRequest(TTL=ttl)
        response = self.call(lambda m, t: m.lease.LeaseGrant(request, timeout=t), timeout=timeout)
        if response.error:
            raise Unavailable(f"etcd refused the lease: {response.error}")
        return int(response.ID), int(response.TTL)

    def lease_revoke(self, lease_id: int, *, timeout: float | None = None) -> None:
        """Revoke a lease (its keys are deleted); an unknown lease is not an error."""
        request = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        try:
            self.call(lambda m, t: m.lease.LeaseRevoke(request, timeout=t), timeout=timeout)
        except LeaseNotFound:
            return

    def lease_keepalive(self, lease_id: int, *, timeout: float | None = None) -> int:
        """Renew a lease once; returns its new TTL, or 0 if it has already expired."""
        request = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)

        def renew(member: _Endpoint, t: float) -> int:
            for response in member.lease.LeaseKeepAlive(iter([request]), timeout=t):
                return int(response.TTL)
            return 0

        return self.call(renew, timeout=timeout)

    def lease_ttl(self, lease_id: int, *, timeout: float | None = None) -> int:
        """Seconds left on a lease (-1 if it does not exist)."""
        request = etcdrpc.LeaseTimeToLiveRequest(ID=lease_id)
        response = self.call(
            lambda m, t: m.lease.LeaseTimeToLive(request, timeout=t), timeout=timeout
        )
        return int(response.TTL)

    # -- maintenance -----------------------------------------------------------------------

    def status(self, *, timeout: float | None = None) -> tuple[int, int]:
        """(member id, leader id) of the member answering."""
        request = etcdrpc.StatusRequest()
        response = self.call(lambda m, t: m.maintenance.Status(request, timeout=t), timeout=timeout)
        return int(response.header.member_id), int(response.leader)

    def watch_stream(self, requests: Iterator[Any]) -> tuple[_Endpoint, Any]:
        """Open a raw watch stream on the current member (used by `consistency.watch`)."""
        member = self.member()
        return member, member.watch.Watch(requests)


class LeaseNotFound(TensorHubError):
    """etcd does not know the lease (it expired or was revoked)."""

    code = "NOT_FOUND"


def _translate(exc: grpc.RpcError, budget: float) -> TensorHubError:
    code = exc.code()
    details = exc.details() or ""
    if is_deadline(exc):
        return DeadlineExceeded(f"etcd did not answer within {budget:.1f}s ({details})")
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"no etcd member answered within {budget:.1f}s: {details}")
    if code == grpc.StatusCode.NOT_FOUND and "lease" in details:
        return LeaseNotFound(details)
    if code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in details:
        return RevisionCompacted(details, 0)
    return TensorHubError(f"etcd error {code.name}: {details}")
