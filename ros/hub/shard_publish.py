"""A replica's batches of model-parallel shard publishes (`ros.hub.group_commit` over
`consistency.shard_commit`).

A shard's Publish is checked and its manifest staged in a worker, like any unary call; then
it waits, holding no worker, for a batch of its version, and the batch commits in one
transaction with every other shard of that version waiting on this replica by then. Shards
of one version that arrive at other replicas batch there; their batches serialize in etcd on
the version's counter. Different versions, models and tenants never share a batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from consistency import Etcd, Keys, VersionRegistry
from consistency.publishing import Admit, Published
from consistency.shard_entries import FIXED_OPS, MAX_BATCH, MAX_TXN_OPS, ShardEntry, take
from consistency.shard_state import Carried
from ros.hub.budget import BatchBudget
from ros.hub.group_commit import MAX_KEYS_COUNTED, GroupCommit
from ros.hub.tenants import Tenant
from ros.metrics import HUB_PUBLISHES_REFUSED
from tensorhub.errors import TensorHubError
from tensorhub.lru import SizedLru

Key = tuple[str, str, int]  # tenant, model, version
Waiting = asyncio.Future[Published]  # a shard's outcome, once its batch has committed


@dataclass
class ShardJob:
    """One staged shard publish and what its batch needs to know of its caller: the tenant
    (its quotas), the registry (its retention) and the model quota's admission."""

    tenant: Tenant
    registry: VersionRegistry
    admit_model: Admit
    entry: ShardEntry


class ShardBatches:
    """Group commit of shard publishes, one batch in flight per version (module docstring)."""

    def __init__(self, etcd: Etcd, keys: Keys, executor: Executor, history_period: float) -> None:
        """`history_period`: the compactor's interval (the tenants' history budgets)."""
        self._etcd = etcd
        self._keys = keys
        self._history_period = history_period
        # shards of each version counted in etcd as this replica's last batch of it read or
        # wrote the counter (other replicas' batches included): what a linger still expects
        self._counted: SizedLru[Key, int] = SizedLru(MAX_KEYS_COUNTED, lambda _: 1)
        # what each version's next batch would read, as its last batch here left it: the
        # next one sends its transaction without reading first (`ShardCommitter.carried`)
        self._carried: SizedLru[Key, Carried] = SizedLru(MAX_KEYS_COUNTED, lambda _: 1)
        self.group: GroupCommit[Key, ShardJob, Published] = GroupCommit(
            executor, self._commit, _take, self._abandon, kind="shards", linger=self._linger,
            window=WINDOW,
        )  # fmt: skip

    async def publish(self, model: str, version: int, job: ShardJob) -> Published:
        """Commit `job` in its version's next batch; its outcome, raised if an error."""
        return await self.group.submit((job.tenant.name, model, version), job)

    def publish_all(self, staged: Sequence[tuple[str, int, ShardJob]]) -> list[Waiting]:
        """Commit shards handed in together, each `(model, version, job)`, in their
        versions' next batches (those of one version join its queue in one step): a future
        of each one's outcome, in order."""
        keys: dict[Key, list[int]] = {}
        for at, (model, version, job) in enumerate(staged):
            keys.setdefault((job.tenant.name, model, version), []).append(at)
        waiting: dict[int, Waiting] = {}
        for key, ats in keys.items():
            futures = self.group.submit_all(key, [staged[at][2] for at in ats])
            waiting.update(zip(ats, futures, strict=True))
        return [waiting[at] for at in range(len(staged))]

    def _commit(self, key: Key, jobs: list[ShardJob]) -> Sequence[Published | TensorHubError]:
        """One batch (run in a worker): the first job's tenant, registry and admission
        speak for the batch (all of one tenant's model). It starts from what the version's
        previous batch here left (`Carried`: one transaction instead of a read and a
        transaction while nothing else wrote the version), and leaves its own."""
        tenant, model, version = key
        first = jobs[0]
        committer = first.registry.shard_committer(
            tenant, model, version, admit_model=first.admit_model,
            budget=BatchBudget(self._etcd, self._keys, first.tenant, self._history_period),
        )  # fmt: skip
        committer.carried = self._carried.get(key)
        try:
            return committer.commit([job.entry for job in jobs])
        finally:
            self._counted.put(key, max(self._counted.get(key) or 0, committer.arrived))
            if committer.budget_refused:  # counted on the committer's final say only
                HUB_PUBLISHES_REFUSED.labels("etcd_budget").inc(committer.budget_refused)
            if committer.carried is None:
                self._carried.pop(key)
            else:
                self._carried.put(key, committer.carried)

    def _linger(self, key: Key, jobs: list[ShardJob], submitted: int) -> float:
        """`_linger`, also going at once when the shards counted in etcd (as last read
        here) and those waiting make the version whole."""
        if (self._counted.get(key) or 0) + len(jobs) >= jobs[0].entry.count:
            return 0.0
        return _linger(jobs, submitted)

    def _abandon(self, key: Key, jobs: list[ShardJob]) -> None:
        """Pages of shards whose callers left before their batch: deleted, best effort
        (what is left goes with the session's lease)."""
        tenant, model, version = key
        for job in jobs:
            committer = job.registry.shard_committer(tenant, model, version)
            committer.commit([_expired(job.entry)])


def _expired(entry: ShardEntry) -> ShardEntry:
    """The entry with its deadline passed: committing it only cleans up after it."""
    entry.deadline = 0.0
    return entry


LINGER = 0.05  # the most a batch with room left waits for more shards of its version
WINDOW = 2 * MAX_BATCH  # the oldest waiting shards a batch is taken from (`GroupCommit`)


def _linger(jobs: list[ShardJob], submitted: int) -> float:
    """Wait up to `LINGER` for more shards while the batch has room for another and this
    replica has seen fewer shards of the version than it has (more may still come); else go
    now: the batch that carries the version's last shard never waits. `GroupCommit` asks
    only of a batch that gathered while a transaction ran, and ends the wait at a lull."""
    entries = [job.entry for job in jobs[: MAX_BATCH + 1]]  # more than one batch holds
    if submitted >= entries[0].count or len(take(list(entries))) < len(entries):
        return 0.0  # every shard is here, or the waiting ones fill more than a batch
    room = MAX_TXN_OPS - FIXED_OPS - sum(e.ops for e in entries)
    return LINGER if room >= 2 and len(entries) < MAX_BATCH else 0.0


def _take(jobs: list[ShardJob]) -> list[ShardJob]:
    """`consistency.shard_entries.take` over jobs: one etcd transaction's worth."""
    chosen = {id(e) for e in take([job.entry for job in jobs])}
    taken: list[ShardJob] = []
    kept: list[ShardJob] = []
    for job in jobs:  # both in the queue's order (`take` keeps it)
        (taken if id(job.entry) in chosen else kept).append(job)
    jobs[:] = kept
    return taken
