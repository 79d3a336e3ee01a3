"""The hub's side of sessions in etcd: grant a session's lease, mark it as its tenant's
within the session quota, tell whether a lease is a live session of a tenant, revoke it.

A session is an etcd lease (`consistency.session.Session`) marked as its tenant's by a key
attached to it (`Keys.session`, written by `ros.hub.session_marks`). The hub's session and
holder handlers ask this registry, so that the lease requests and the session key schema
stay in `consistency`.
"""

from __future__ import annotations

from collections.abc import Sequence

from consistency import ops
from consistency.etcd import Etcd
from consistency.keys import Keys
from consistency.quota import CountedCreate
from consistency.session import Session
from tensorhub.errors import SessionExpired


class SessionRecords:
    """Sessions' leases and marks in etcd, for the hub's handlers."""

    def __init__(self, etcd: Etcd, keys: Keys) -> None:
        self._etcd = etcd
        self._keys = keys

    def grant(self, ttl: int) -> Session:
        """A lease of `ttl` seconds that nothing renews yet (its owner will, by KeepAlive)."""
        return Session(self._etcd, ttl=ttl, keepalive=False)

    def key(self, tenant: str, session_id: int) -> str:
        """The key that marks `session_id` as `tenant`'s: a write that names it as its
        session compares it in its own transaction (`session_key=`)."""
        return self._keys.session(tenant, session_id)

    def own(self, tenant: str, session_id: int, timeout: float) -> None:
        """Refuse to attach records to a lease that is not one of this tenant's live sessions.

        A session that is not this tenant's is answered exactly as a missing one:
        `SessionExpired` (a `LeaseLost`), with the same message, after the same one etcd
        read, so that a tenant cannot find other tenants' live session ids by scanning; to
        the caller's own SDK both mean the same thing: that id is no session of its own,
        open a new one.
        """
        kv, _ = self._etcd.get(self.key(tenant, session_id), timeout=timeout)
        if kv is None:
            raise SessionExpired(
                f"session {session_id:x} has expired or was revoked: open a new one"
            )

    def alive(self, session_id: int, timeout: float) -> bool:
        """Whether etcd still knows the session's lease."""
        return self._etcd.lease_ttl(session_id, timeout=timeout) >= 0

    def quota(self, tenant: str, max_sessions: int) -> CountedCreate:
        """The tenant's session quota: what a batch of marks compares and bumps so that at
        most `max_sessions` sessions are marked as the tenant's, race-free."""
        sessions = self._keys.sessions(tenant)
        return CountedCreate(
            self._etcd,
            self._keys.quota_fence(tenant, "sessions"),
            max_sessions,
            # a count, not the keys: at thousands of sessions a listing per batch is O(N)
            lambda t: self._etcd.count(sessions, timeout=t),
            f"sessions of tenant {tenant}",
        )

    def mark(
        self,
        writer: Etcd,
        tenant: str,
        session_ids: Sequence[int],
        guard: list[ops.Cmp],
        bump: list[ops.Op],
        timeout: float,
    ) -> int | None:
        """Mark `session_ids` as `tenant`'s, each under its own lease, in one transaction
        that compares `guard` and writes `bump` (the quota's admission) with `writer` (the
        tenant's fenced connection): its revision, or None when `guard` no longer held.
        `LeaseNotFound` when a lease of the batch is gone."""
        marks = [ops.put(self.key(tenant, s), b"", lease=s) for s in session_ids]
        result = writer.txn(guard, [*marks, *bump], timeout=timeout)
        return int(result.revision) if result.succeeded else None

    def revoke(self, session_id: int, timeout: float) -> None:
        """End the session: its lease goes, and every record attached to it."""
        self._etcd.lease_revoke(session_id, timeout=timeout)
