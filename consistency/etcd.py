"""A typed etcd v3 client with per-call deadlines and failover across members.

Built on the generated stubs of python3-etcd3 (`etcd3.etcdrpc`) rather than its client class:
that class has one timeout for all calls, locks a failed member out for 300 s, and its watch
thread breaks on stream errors (it calls an unimported `six`). Here every call takes a deadline,
a member that fails is skipped for a short while, and retries follow `consistency.retry`.
Reads are linearizable (never `serializable`).

Credentials (`consistency.credentials.EtcdCredentials`) add TLS to every channel and etcd auth
(`consistency.etcd_auth`): the hub logs in on first use, resends once a call refused for its
token, and opens streams with tokens younger than `STREAM_TOKEN_AGE`. gRPC errors become
`TensorHubError`s in `consistency.etcd_errors`.

Here: the client's calls (KV, transactions and their fence, leases, maintenance, watch
streams). Its members and how one call reaches them (channels, failover, retries, the token's
resend) are `consistency.etcd_members`; what the calls answer, `consistency.etcd_results`.
"""

from __future__ import annotations

import copy
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
from consistency.credentials import EtcdCredentials
from consistency.etcd_auth import STREAM_TOKEN_AGE, Token
from consistency.etcd_errors import translate
from consistency.etcd_members import DEFAULT_TIMEOUT, Endpoint, EtcdMembers
from consistency.etcd_results import Alarm, MemberStatus, RangeResult, TxnResult
from consistency.ops import KV, Cmp, Op
from consistency.protowire import scan_fields
from consistency.retry import DEFAULT_POLICY, RetryPolicy
from tensorhub.errors import (
    DeadlineExceeded,
    InvalidArgument,
    LeaseNotFound,
    OutcomeUnknown,
    TensorHubError,
    Unavailable,
    WriteUnconfirmed,
)

__all__ = ["DEFAULT_TIMEOUT", "Alarm", "Etcd", "MemberStatus", "RangeResult", "TxnResult"]

T = TypeVar("T")


@dataclass(frozen=True)
class Fence:
    """A key whose create revision every write of a fenced `Etcd` view compares: the
    tenant record, so that nothing is written for a tenant that was deleted (or deleted and
    created again) since the caller authenticated, whatever any cache says. `refusal` is
    raised when it no longer holds."""

    key: str
    create_revision: int
    refusal: Callable[[], TensorHubError]


class Etcd(EtcdMembers):
    """Connection to an etcd cluster given as `host:port` endpoints (one or several members).

    `credentials` (None: no auth, no TLS) are what a production etcd needs: a user and
    password for etcd auth, and a CA (and client certificate) for TLS. An `https://`
    endpoint is refused without TLS credentials, so TLS cannot silently be dropped.
    `stream_token_age` must stay under etcd's `--auth-token-ttl` (see `STREAM_TOKEN_AGE`).
    """

    def __init__(
        self,
        endpoints: list[str] | str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        policy: RetryPolicy = DEFAULT_POLICY,
        credentials: EtcdCredentials | None = None,
        stream_token_age: float = STREAM_TOKEN_AGE,
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = [e for e in endpoints.split(",") if e]
        if not endpoints:
            raise InvalidArgument("at least one etcd endpoint is needed")
        if any(e.startswith("https://") for e in endpoints) and not (
            credentials is not None and credentials.tls
        ):
            raise InvalidArgument("an https:// etcd endpoint needs TLS credentials (--etcd-ca)")
        self.endpoints = [_strip_scheme(e) for e in endpoints]
        self.timeout = timeout
        self.policy = policy
        self.credentials = credentials
        self._token = (
            Token(credentials, stream_token_age)
            if credentials is not None and credentials.auth
            else None
        )
        self._members = [Endpoint(e, credentials, self._token) for e in self.endpoints]
        self._lock = threading.Lock()
        self._current = 0
        self._counter = itertools.count()
        self._fence: Fence | None = None

    def fenced(self, fence: Fence) -> Etcd:
        """This connection, with `fence` compared in every transaction that writes: a view
        sharing the members and their channels (cheap: one per call is fine)."""
        view = copy.copy(self)
        view._fence = fence
        return view

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

    def page(
        self,
        prefix: str,
        after: str,
        limit: int,
        *,
        revision: int = 0,
        timeout: float | None = None,
    ) -> tuple[list[KV], bool]:
        """At most `limit` keys under `prefix` that sort after `prefix + after` (`ops.page`'s
        range, outside a transaction), read at `revision` (0: now), and whether more follow:
        a long prefix read a page at a time, every page at one revision."""
        request = ops.page(prefix, after, limit).request_range
        request.revision = revision
        response = self.call(lambda m, t: m.kv.Range(request, timeout=t), timeout=timeout)
        return [KV.from_pb(kv) for kv in response.kvs], bool(response.more)

    def range_keys(
        self, prefix: str | bytes, *, timeout: float | None = None
    ) -> tuple[list[bytes], int]:
        """Every key under `prefix`, in order, and the revision read (a linearizable read
        of the keys alone): `range(keys_only=True)` without a `KV` made a key, for a scan of
        thousands (a version's shard and holder records)."""
        request = etcdrpc.RangeRequest(
            key=ops.b(prefix), range_end=ops.prefix_end(prefix), keys_only=True
        )
        response = self.call(lambda m, t: m.kv.Range(request, timeout=t), timeout=timeout)
        return [kv.key for kv in response.kvs], int(response.header.revision)

    def count(self, prefix: str | bytes, *, timeout: float | None = None) -> int:
        """How many keys start with `prefix` (a linearizable count: no keys are sent)."""
        request = etcdrpc.RangeRequest(
            key=ops.b(prefix), range_end=ops.prefix_end(prefix), count_only=True
        )
        response = self.call(lambda m, t: m.kv.Range(request, timeout=t), timeout=timeout)
        return int(response.count)

    def txn(
        self,
        compare: list[Cmp],
        success: list[Op],
        failure: list[Op] | None = None,
        *,
        timeout: float | None = None,
    ) -> TxnResult:
        """One transaction; see `TxnResult.attempts` for what a retried write means.

        On a fenced view (`fenced`), a transaction that writes also compares the fence's key
        and raises the fence's refusal, writing nothing, when that compare failed."""
        fence = self._fence
        fenced = fence is not None and _writes([*success, *(failure or [])])
        if fenced:
            assert fence is not None
            compare = [*compare, ops.create(fence.key, "==", fence.create_revision)]
            failure = [*(failure or []), ops.get(fence.key)]
        request = ops.txn_request(compare, success, failure)
        attempts = 0

        def send(member: Endpoint, t: float) -> Any:
            nonlocal attempts
            attempts += 1
            return member.kv.Txn(request, timeout=t)

        try:
            response = self.call(send, timeout=timeout)
        except LeaseNotFound:
            # etcd refuses a write under a lease it does not know before any compare: for
            # a tenant deleted meanwhile (its leases revoked), say that, not the lease.
            if fenced:
                assert fence is not None
                self._check_fence(fence, timeout)
            raise
        except WriteUnconfirmed as exc:
            if _writes([*success, *(failure or [])]):
                raise OutcomeUnknown(str(exc)) from exc  # a read that timed out changed nothing
            raise
        responses = list(response.responses)
        if fenced and not response.succeeded:
            assert fence is not None
            found = responses.pop().response_range.kvs
            if not found or int(found[0].create_revision) != fence.create_revision:
                raise fence.refusal()
        return TxnResult(
            bool(response.succeeded), int(response.header.revision), responses, attempts
        )

    def _check_fence(self, fence: Fence, timeout: float | None) -> None:
        """Raise the fence's refusal if its key is gone or was created again."""
        found = self.call(
            lambda m, t: m.kv.Range(etcdrpc.RangeRequest(key=ops.b(fence.key)), timeout=t),
            timeout=timeout,
        ).kvs
        if not found or int(found[0].create_revision) != fence.create_revision:
            raise fence.refusal()

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

        def renew(member: Endpoint, t: float) -> int:
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

    def call_member(
        self, endpoint: str, fn: Callable[[Endpoint, float], T], *, timeout: float | None = None
    ) -> T:
        """Run `fn` on the member at `endpoint` only (no failover), retrying until the deadline.

        For calls that are about one member (status, defragment): answering from another
        member would be a wrong answer, not a failover.
        """
        budget = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        target = _strip_scheme(endpoint)
        member = next((m for m in self._members if m.target == target), None)
        if member is None:
            raise InvalidArgument(f"{endpoint!r} is not one of this client's endpoints")
        try:
            for attempt in self.policy.retrying(deadline):
                with attempt:
                    return self._with_token(fn, member, max(deadline - time.monotonic(), 0.01))
        except grpc.RpcError as exc:
            raise translate(exc, budget) from exc
        raise DeadlineExceeded(f"etcd member {target} did not answer within {budget:.1f}s")

    def member_status(self, endpoint: str, *, timeout: float | None = None) -> MemberStatus:
        """Maintenance status of the member at `endpoint`, database sizes included."""
        request = etcdrpc.StatusRequest()
        response = self.call_member(
            endpoint, lambda m, t: m.maintenance.Status(request, timeout=t), timeout=timeout
        )
        # The vendored stubs predate etcd 3.4's fields; protobuf keeps them as unknown fields.
        extra = scan_fields(response.SerializeToString())
        in_use = extra.get(9)
        errors = extra.get(8)
        return MemberStatus(
            endpoint=endpoint,
            member_id=int(response.header.member_id),
            leader=int(response.leader),
            version=str(response.version),
            db_size=int(response.dbSize),
            db_size_in_use=in_use[-1] if in_use and isinstance(in_use[-1], int) else None,
            raft_index=int(response.raftIndex),
            errors=tuple(e.decode(errors="replace") for e in errors or () if isinstance(e, bytes)),
        )

    def defragment(self, endpoint: str, *, timeout: float = 60.0) -> None:
        """Defragment the member at `endpoint`: it stops serving while it rewrites its file.

        Call one member at a time, so a quorum keeps serving. Not retried on another member.
        """
        request = etcdrpc.DefragmentRequest()
        self.call_member(
            endpoint, lambda m, t: m.maintenance.Defragment(request, timeout=t), timeout=timeout
        )

    def alarms(self, *, timeout: float | None = None) -> list[Alarm]:
        """The cluster's active alarms (NOSPACE: a member's database hit its quota)."""
        request = etcdrpc.AlarmRequest(
            action=etcdrpc.AlarmRequest.GET, memberID=0, alarm=etcdrpc.NONE
        )
        response = self.call(lambda m, t: m.maintenance.Alarm(request, timeout=t), timeout=timeout)
        return [Alarm(int(a.memberID), etcdrpc.AlarmType.Name(a.alarm)) for a in response.alarms]

    def disarm(self, alarm: Alarm, *, timeout: float | None = None) -> None:
        """Deactivate one alarm; etcd raises it again on the next write if it still applies."""
        request = etcdrpc.AlarmRequest(
            action=etcdrpc.AlarmRequest.DEACTIVATE,
            memberID=alarm.member_id,
            alarm=etcdrpc.AlarmType.Value(alarm.kind),
        )
        self.call(lambda m, t: m.maintenance.Alarm(request, timeout=t), timeout=timeout)

    def watch_stream(self, requests: Iterator[Any]) -> tuple[Endpoint, Any]:
        """Open a raw watch stream on the current member (used by `consistency.watch_mux`)."""
        member = self.member()
        return member, member.watch.Watch(requests)


def _strip_scheme(endpoint: str) -> str:
    return endpoint.removeprefix("http://").removeprefix("https://")


def _writes(operations: list[Op]) -> bool:
    """Whether a transaction's branches write (anything but a range read; a nested
    transaction counts as a write)."""
    return any(op.WhichOneof("request") != "request_range" for op in operations)
