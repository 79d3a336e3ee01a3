"""A replica's batches of session marks: OpenSession in a herd (`ros.hub.group_commit`).

Opening a session grants a lease, then marks it as the tenant's (`s/{id}` under the lease)
within the tenant's session quota, race-free: the mark's transaction compares the tenant's
session fence as read before the count (`consistency.quota`). When 2,000 clients open at
once, one mark per transaction means every transaction but one fails that compare and counts
again: O(N^2) reads, and leases that expire before their mark commits (790 of 2,000 opens
failed at 30 s). Here the marks of one tenant waiting at the same moment commit together: one
fence read, one count and one transaction per batch of up to `MAX_BATCH` sessions, the quota
admitting the first ones that fit and refusing the rest with `QuotaExceeded`. Replicas batch
on their own; their batches race on the fence only with each other.

A session whose lease is gone before its batch commits (its TTL ran out while it waited)
makes etcd refuse the whole transaction; the batch asks which leases are dead, fails those
with `SessionExpired`, and commits the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from consistency import Etcd
from consistency.retry import CAS_POLICY, LostRace
from consistency.sessions import SessionRecords
from consistency.shard_entries import MAX_TXN_OPS
from ros.hub.group_commit import GroupCommit
from ros.hub.tenants import Tenant
from tensorhub.errors import (
    DeadlineExceeded,
    LeaseNotFound,
    PermissionDenied,
    SessionExpired,
    TensorHubError,
)

MAX_BATCH = MAX_TXN_OPS - 1  # each mark is one put; the fence's put is the last


@dataclass
class MarkJob:
    """One session to mark as `tenant`'s, by `deadline` (time.monotonic())."""

    tenant: Tenant
    session: int
    deadline: float


class SessionMarks:
    """Group commit of session marks, one batch in flight per tenant (module docstring)."""

    def __init__(
        self, records: SessionRecords, executor: Executor, etcd_for: Callable[[Tenant], Etcd]
    ) -> None:
        """`records`: the sessions in etcd (every request a batch makes);
        `etcd_for(tenant)`: the connection a batch of `tenant`'s marks is written with
        (the hub's fences each write on the tenant's record)."""
        self._records = records
        self._etcd_for = etcd_for
        self.group: GroupCommit[str, MarkJob, int] = GroupCommit(
            executor, self._commit, _take, kind="sessions"
        )

    async def mark(self, job: MarkJob) -> int:
        """Mark `job`'s session in its tenant's next batch; the mark's revision."""
        return await self.group.submit(job.tenant.name, job)

    def _commit(self, tenant: str, jobs: list[MarkJob]) -> Sequence[int | TensorHubError]:
        """One batch (run in a worker), retried on a lost race with another replica."""
        quota = self._records.quota(tenant, jobs[0].tenant.quotas.max_sessions)
        outcomes: dict[int, int | TensorHubError] = {}
        pending = list(jobs)
        writer = self._etcd_for(jobs[0].tenant)

        def attempt() -> None:
            now = time.monotonic()
            for job in pending:
                if job.deadline <= now:
                    outcomes[id(job)] = DeadlineExceeded(
                        "opening a session: its deadline passed before it was marked"
                    )
            pending[:] = [j for j in pending if id(j) not in outcomes]
            if not pending:
                return
            remaining = max(max(j.deadline for j in pending) - now, 0.05)
            admitted, guard, bump, refusal = quota.admit_many(len(pending), remaining)
            for job in pending[admitted:]:
                outcomes[id(job)] = refusal or DeadlineExceeded("not admitted")
            marking = pending[:admitted]
            pending[:] = marking
            if not marking:
                return
            try:
                revision = self._records.mark(
                    writer, tenant, [j.session for j in marking], guard, bump, remaining
                )
            except LeaseNotFound:
                self._dead(marking, outcomes)
                pending[:] = [j for j in pending if id(j) not in outcomes]
                raise LostRace("a session of the batch had expired") from None
            if revision is None:  # another replica's batch marked meanwhile
                raise LostRace(f"the sessions fence of tenant {tenant} moved")
            for job in marking:
                outcomes[id(job)] = revision
            pending.clear()

        deadline = max(j.deadline for j in jobs)
        try:
            CAS_POLICY.compare_and_set(
                attempt,
                deadline,
                lambda: DeadlineExceeded("opening a session: the session count kept changing"),
            )
        except (DeadlineExceeded, PermissionDenied) as exc:  # PermissionDenied: tenant deleted
            for job in pending:
                outcomes.setdefault(id(job), exc)
        return [outcomes[id(j)] for j in jobs]

    def _dead(self, jobs: list[MarkJob], outcomes: dict[int, int | TensorHubError]) -> None:
        """Which of the batch's leases etcd no longer knows: their opens fail."""
        for job in jobs:
            try:
                alive = self._records.alive(job.session, timeout=2.0)
            except TensorHubError:
                continue  # unknown: the next attempt tells
            if not alive:
                outcomes[id(job)] = SessionExpired(
                    f"session {job.session:x} expired before it could be opened: its TTL "
                    "ran out while the hub marked it; open a new one"
                )


def _take(jobs: list[MarkJob]) -> list[MarkJob]:
    """The oldest `MAX_BATCH` waiting marks (removed from `jobs`)."""
    batch = jobs[:MAX_BATCH]
    del jobs[:MAX_BATCH]
    return batch
