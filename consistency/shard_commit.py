"""Group commit of a model-parallel version's shards: many ranks' shards in one transaction.

After an optimizer step every rank publishes its shard of the new version at once. Committed
one transaction per shard, those N transactions all write one shared key (the version's
shard counter) and the tenant's usage key, so they fail each other's compares or queue on a
lock: 4,096 shards take 244 s that way (20,785x one shard). Here the shards of one version that are
waiting at the same moment commit together, as many per transaction as etcd's default
`--max-txn-ops` (128) allows, so N shards cost about N / 61 transactions, and the shared keys
are written once per batch instead of once per shard.

One batch is one transaction:

- compares: `latest` and the version's counter `arrived` unchanged since read (so batches of
  one version committed by different hub replicas serialize in etcd, and the one that
  completes the version is exactly one), each shard's record absent, each paged manifest's
  pages still present, plus the model quota's fence and the tenant's usage (`Budget`);
- puts: each shard's record and its holder record (under the rank's session lease), each
  paged manifest's pages detached from the lease, the pack of the batch's packed manifests
  (a group publish's: `consistency.manifest_packs`), the counter (`{"count": n, "arrived": k}`),
  the usage and the fence; and, in the batch that brings `arrived` to `n`, `latest` and the
  version's header `{"shards": n}`. So the version becomes visible exactly once, atomically,
  with its last shard, and `Latest` never shows a partial version.

A shard published with views (docs/views.md, "Views of model-parallel versions") carries
its rank's shard of each view (`ViewShard`): the same shard index of version v of the view
model `{model}.{fmt}`, staged like its own. Its batch writes each view shard's record and
holder record (and pages' commits) beside the shard's, and the batch that completes the
version writes each view's header `{"shards": n}` and `latest` with the version's, under
compares that each view version is absent: the version and its views become visible at one
revision, or none of them. The counter names the views (`"views"`), and every shard of a
version must carry the same ones (`InvalidArgument` for one that does not).

Every attempt starts with one read-only transaction (latest, the counter, each shard's record
and holder record), or, for a version's next batch on the same committer, with its
transaction alone on the state its last batch wrote (`Carried`: the counter and usage as
written, `latest` as compared, no shard record), which commits only while nothing changed
since: a failed compare, or a state that would decide a shard alone, sends the batch to the
read. The read is also the retry-safe check for our own earlier write: a shard
whose record is there, written for its holder under its session, succeeded (a retried
publish after a lost reply is idempotent); one written by the same holder name with the same
manifest under another session (a rank that restarted) becomes that shard's holder again and
succeeds; one written by another holder, or with another manifest, is `AlreadyExists`.
A shard that fails alone fails alone, with its named error, and the rest of its batch
commits: a shard count that disagrees (`InvalidArgument`), a budget that is full
(`QuotaExceeded`), a session that died while its shard waited (`SessionExpired`: etcd refuses
a whole transaction that writes under a missing lease, so the batch finds the dead leases and
commits again without them), pages that vanished with their lease (`LeaseLost`). Pages of a
shard that definitely failed are deleted at once.

Here: the committer's attempts, its transaction and their retries. Beside it, by job: a
waiting shard and `take` (`consistency.shard_entries`), the counter, a read's state and the
carried one (`consistency.shard_state`), the read and what it decides
(`consistency.shard_reads`), the batch's shared compares and the budget
(`consistency.shard_guards`).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from consistency import manifest_packs, ops
from consistency.etcd import Etcd
from consistency.keys import Keys
from consistency.manifests import ManifestStore
from consistency.publishing import Admit, Published
from consistency.records import ShardRecord
from consistency.retry import CAS_POLICY, LostRace
from consistency.shard_entries import Outcome, ShardEntry
from consistency.shard_guards import Budget, ShardGuards
from consistency.shard_reads import ShardReads
from consistency.shard_state import BatchRead, Carried
from tensorhub.errors import (
    DeadlineExceeded,
    LeaseLost,
    LeaseNotFound,
    OutcomeUnknown,
    SessionExpired,
    TensorHubError,
    Unavailable,
)


class ShardCommitter(ShardReads, ShardGuards):
    """Commits batches of shards of one version `tenant/model@version` (module docstring).

    `admit_model` (the model quota) is asked while the model has no `latest`; `budget`
    (the tenant's usage) is charged per batch; `on_visible(tenant, model)` runs after the
    batch that made the version visible (retention)."""

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        manifests: ManifestStore,
        tenant: str,
        model: str,
        version: int,
        *,
        admit_model: Admit | None = None,
        budget: Budget | None = None,
        on_visible: Callable[[str, str], None] | None = None,
    ) -> None:
        self.etcd = etcd
        self.keys = keys
        self.manifests = manifests
        self.tenant = tenant
        self.model = model
        self.version = version
        self._admit = admit_model
        self._budget = budget
        self._on_visible = on_visible
        self._arrived = keys.shard_arrivals(tenant, model, version)
        self._latest = keys.latest(tenant, model)
        self._shards = keys.shards(tenant, model, version)
        self._holders = keys.holders(tenant, model, version)
        self._found: set[int] = set()  # entries whose earlier write a read found (per commit)
        self.arrived = 0  # the version's shards counted, as this committer last read or wrote
        # What its batch's own read would find after its last batch committed (`carried`):
        # the next batch tries its transaction on it before reading.
        self.carried: Carried | None = None
        self.budget_refused = 0  # shards the budget refused, on a state read (a final say)

    def _view_writes(self, entry: ShardEntry) -> tuple[list[ops.Cmp], list[ops.Op]]:
        """The compares and puts of the entry's view shards: each absent and its pages
        there; each record, holder record (under the rank's lease) and pages' commits."""
        compares: list[ops.Cmp] = []
        puts: list[ops.Op] = []
        for view in entry.views:
            key = self.keys.shard(self.tenant, view.model, self.version, entry.index)
            compares += [ops.absent(key), *view.staged.compares]
            puts += [
                ops.put(key, view.record),
                ops.put(
                    self.keys.holder(self.tenant, view.model, self.version, entry.holder.holder),
                    entry.holder.encode(),
                    lease=entry.holder.session,
                ),
                *view.staged.commits,
            ]
        return compares, puts

    # -- the batch -------------------------------------------------------------------------

    def commit(self, entries: Sequence[ShardEntry]) -> list[Outcome]:
        """Commit `entries` (one batch: see `take`), retrying lost races until each has an
        outcome or its deadline passes; the outcomes in `entries`' order. Never raises for
        one entry's failure: each gets its own."""
        outcomes: dict[int, Outcome] = {}
        self._found = set()
        pending = list(entries)

        def attempt() -> None:
            now = time.monotonic()
            for entry in [e for e in pending if e.deadline <= now]:
                outcomes[id(entry)] = self._expired(entry)
            pending[:] = [e for e in pending if id(e) not in outcomes]
            if not pending:
                return
            self._attempt(pending, outcomes)
            pending[:] = [e for e in pending if id(e) not in outcomes]
            if pending:
                raise LostRace(f"{self.what()} moved during a batch of its shards")

        deadline = max(e.deadline for e in entries) if entries else time.monotonic()
        with contextlib.suppress(LostRace):  # each entry still pending gets its outcome below
            CAS_POLICY.compare_and_set(attempt, deadline, lambda: LostRace("deadline"))
        for entry in pending:
            outcomes.setdefault(id(entry), self._expired(entry))
        for entry in entries:
            if id(entry) in self._found or not isinstance(outcomes[id(entry)], Published):
                self._discard(entry, outcomes[id(entry)])
        return [outcomes[id(e)] for e in entries]

    def _expired(self, entry: ShardEntry) -> TensorHubError:
        if entry.ambiguous:
            return OutcomeUnknown(
                f"publish of {self.what(entry)} outcome unknown at its deadline: check "
                "latest() or inspect"
            )
        return DeadlineExceeded(f"publish of {self.what(entry)} did not complete in time")

    def _discard(self, entry: ShardEntry, outcome: Outcome) -> None:
        """Delete the pages of a shard that definitely failed, or whose earlier publish
        won with other pages, unless its record names them (then they are live). An unknown
        outcome leaves them: live if it committed, gone with the lease if not."""
        if isinstance(outcome, OutcomeUnknown):
            return
        for view in entry.views:
            if view.staged.prefix:
                key = self.keys.shard(self.tenant, view.model, self.version, entry.index)
                self.manifests.discard(view.staged, key, view.record, 2.5)
        if entry.staged.prefix:
            self.manifests.discard(entry.staged, self._shard_key(entry), entry.record, 2.5)

    def _attempt(self, pending: list[ShardEntry], outcomes: dict[int, Outcome]) -> None:
        """One read and, for what is left to write, one transaction; or, with a state
        carried from this version's previous batch (`carried`), first that transaction
        alone, then the read if it did not commit the batch whole. Sets the outcome of
        every entry it decides; raising `LostRace` (by leaving entries pending) retries."""
        remaining = max(max(e.deadline for e in pending) - time.monotonic(), 0.05)
        carried, self.carried = self.carried, None
        if carried is not None:
            trial: dict[int, Outcome] = {}
            if self._write(pending, carried.state, trial, remaining, carried=True):
                outcomes.update(trial)
                return
        try:
            state = self._read(pending, remaining)
        except (Unavailable, DeadlineExceeded):
            return  # nothing sent: try again while time is left
        self._write(pending, state, outcomes, remaining)

    def _write(
        self,
        pending: list[ShardEntry],
        state: BatchRead,
        outcomes: dict[int, Outcome],
        remaining: float,
        *,
        carried: bool = False,
    ) -> bool:
        """Decide on `state` what it decides, then write the rest in one transaction;
        whether every entry of `pending` committed in it. With `carried` (`state` was not
        read: `carried`), only a batch that commits whole counts: anything `state` decides
        alone (a shard found, a refusal) or a transaction that fails leaves the entries to
        the read that follows, and what was put in `outcomes` is dropped."""
        writing, rehold = self._settle(pending, state, outcomes)
        if carried and (rehold or len(writing) < len(pending)):
            return False
        if rehold:
            self._rehold(rehold, state, outcomes, remaining)
        if not writing:
            return False
        compares, puts, visible = self._guards(writing, state, outcomes, remaining, carried)
        charged = list(puts)
        written = [e for e in writing if id(e) not in outcomes]
        if not written or (carried and len(written) < len(writing)):
            return False
        writing = written
        records = self._pack(writing, puts)
        for entry in writing:
            compares += [ops.absent(self._shard_key(entry)), *entry.staged.compares]
            puts += [
                ops.put(self._shard_key(entry), records.get(id(entry), entry.record)),
                ops.put(self._holder_key(entry), entry.holder.encode(), lease=entry.holder.session),
                *entry.staged.commits,
                *entry.extra,
            ]
            view_compares, view_puts = self._view_writes(entry)
            compares += view_compares
            puts += view_puts
        marks = sorted({e.session_key for e in writing if e.session_key})
        compares += [ops.exists(mark) for mark in marks]
        paged = [e for e in writing if e.staged.prefix]
        paged_views = [(e, v) for e in writing for v in e.views if v.staged.prefix]
        try:
            result = self.etcd.txn(
                compares,
                puts,
                [
                    *(op for e in paged for op in e.staged.count_op()),
                    *(op for _, v in paged_views for op in v.staged.count_op()),
                    *(ops.get(mark, count_only=True) for mark in marks),
                ],
                timeout=max(max(e.deadline for e in writing) - time.monotonic(), 0.05),
            )
        except LeaseNotFound:
            if not carried:
                self._dead_sessions(writing, outcomes)
            return False
        except (Unavailable, DeadlineExceeded, OutcomeUnknown):
            for entry in writing:  # it may have been applied: the next read tells
                entry.ambiguous = True
            return False
        if result.attempts > 1:
            for entry in writing:
                entry.ambiguous = True
        if result.succeeded:
            self.arrived = max(self.arrived, state.arrived + len(writing))
            for entry in writing:
                outcomes[id(entry)] = Published(self.version, result.revision, visible)
            if visible and self._on_visible is not None:
                self._on_visible(self.tenant, self.model)
            if not visible:
                self.carried = self._carry(state, writing, charged, result.revision)
            return len(writing) == len(pending)
        if carried:
            return False
        for entry, response in zip(paged, result.responses, strict=False):
            if int(response.response_range.count) < entry.staged.header.pages:
                outcomes[id(entry)] = LeaseLost(
                    f"the manifest pages of {self.what(entry)} vanished before the publish "
                    "committed: the publisher's session (lease) expired"
                )
        views_counted = result.responses[len(paged) : len(paged) + len(paged_views)]
        for (entry, view), response in zip(paged_views, views_counted, strict=True):
            if int(response.response_range.count) < view.staged.header.pages:
                outcomes.setdefault(id(entry), LeaseLost(
                    f"the manifest pages of the {view.model} view of {self.what(entry)} "
                    "vanished before the publish committed: the publisher's session (lease) "
                    "expired"
                ))  # fmt: skip
        counted = result.responses[len(paged) + len(paged_views) :]
        gone = {m for m, r in zip(marks, counted, strict=True) if not r.response_range.count}
        for entry in writing:
            if entry.session_key in gone and id(entry) not in outcomes:
                outcomes[id(entry)] = SessionExpired(
                    f"session {entry.holder.session:x} has expired or was revoked: open a new one"
                )
        return False

    def _pack(self, writing: list[ShardEntry], puts: list[ops.Op]) -> dict[int, bytes]:
        """The pack of the packed manifests among `writing`, added to `puts` under a new id
        (one per transaction: an attempt that fails wrote nothing), and the shard records
        that name it, by entry (`consistency.manifest_packs`)."""
        packed = [e for e in writing if e.packed]
        if not packed:
            return {}
        pack_id = secrets.token_hex(8)
        value, offsets = manifest_packs.build([e.packed for e in packed])
        puts.append(
            ops.put(self.keys.manifest_pack(self.tenant, self.model, self.version, pack_id), value)
        )
        return {
            id(e): ShardRecord(
                e.index, e.count, e.holder.holder,
                manifest_packs.pack(
                    replace(e.staged.header, session=e.holder.session), pack_id, at, len(e.packed)
                ),
            ).encode()
            for e, at in zip(packed, offsets, strict=True)
        }  # fmt: skip

    def _rehold(
        self,
        entries: list[ShardEntry],
        state: BatchRead,
        outcomes: dict[int, Outcome],
        remaining: float,
    ) -> None:
        """A rank that restarted (a new session) publishes again the shard its earlier
        incarnation committed, with the same holder name and the same manifest: it becomes
        that shard's holder again (its record under its new session), and its publish
        succeeds, as a retried publish does. The shard record is unchanged (compared) and not
        counted again, so the version's visibility is as it was."""
        compares = [
            ops.mod(self._shard_key(e), "==", state.records[e.index].mod_revision) for e in entries
        ]
        marks = sorted({e.session_key for e in entries if e.session_key})
        compares += [ops.exists(mark) for mark in marks]
        puts = [
            ops.put(self._holder_key(e), e.holder.encode(), lease=e.holder.session) for e in entries
        ]
        puts += [  # its view shards' holder records, under its new session too
            ops.put(
                self.keys.holder(self.tenant, view.model, self.version, e.holder.holder),
                e.holder.encode(),
                lease=e.holder.session,
            )
            for e in entries
            for view in e.views
        ]
        try:
            result = self.etcd.txn(compares, puts, timeout=remaining)
        except LeaseNotFound:
            self._dead_sessions(entries, outcomes)
            return
        except (Unavailable, DeadlineExceeded, OutcomeUnknown):
            for entry in entries:  # the next read finds our holder records if it landed
                entry.ambiguous = True
            return
        if result.succeeded:
            for entry in entries:
                outcomes[id(entry)] = Published(
                    self.version, result.revision, state.latest >= self.version
                )
                self._found.add(id(entry))  # its own staged pages are not the live ones

    def _dead_sessions(self, writing: list[ShardEntry], outcomes: dict[int, Outcome]) -> None:
        """etcd refused the batch for a lease it does not know: find which sessions died
        (one TimeToLive each) and fail their shards; the rest go again."""
        dead: set[int] = set()
        for lease in {e.holder.session for e in writing}:
            try:
                if self.etcd.lease_ttl(lease, timeout=2.0) < 0:
                    dead.add(lease)
            except TensorHubError:
                continue  # unknown: the next attempt asks again
        for entry in writing:
            if entry.holder.session in dead:
                outcomes[id(entry)] = SessionExpired(
                    f"the session {entry.holder.session:x} publishing {self.what(entry)} "
                    "expired before its shard committed: open a new one"
                )
