"""What a batch of a version's shards reads, and what that read alone decides.

Every attempt of `consistency.shard_commit` starts with one read-only transaction at one
revision (`_read`: `latest`, the counter, each shard's record and holder record, the
tenant's usage), unless it tries a state carried from the version's last batch first
(`_carry`). On that state `_settle` decides each shard the read already decides: our own
earlier write (a retried publish), the same shard under a new session (a rank that
restarted: `_same_shard`), another holder's shard (`AlreadyExists`), a stale version, a
shard count or views that disagree (`InvalidArgument`); the rest go to the transaction.
Apart from the committer because this is where a retried or raced publish is recognized,
with the version's keys (built once per committer) it reads; the committer's transaction
and its retries stay in `consistency.shard_commit`.
"""

from __future__ import annotations

from consistency import ops
from consistency.etcd import Etcd
from consistency.keys import Keys
from consistency.publishing import Published
from consistency.records import HolderRecord, ShardRecord
from consistency.shard_entries import Outcome, ShardEntry
from consistency.shard_guards import Budget
from consistency.shard_state import BatchRead, Carried, decode_counter
from tensorhub.errors import AlreadyExists, InvalidArgument, StaleVersion
from tensorhub.names import validate_name


class ShardReads:
    """A batch's read and what it decides (`_read`, `_settle`, `_carry`), with the
    version's keys and names, for `ShardCommitter`, which derives from it and sets these
    attributes in its `__init__`."""

    etcd: Etcd
    keys: Keys
    tenant: str
    model: str
    version: int
    arrived: int
    _latest: str
    _arrived: str
    _shards: str
    _holders: str
    _budget: Budget | None
    _found: set[int]

    # -- keys ------------------------------------------------------------------------------

    def _shard_key(self, entry: ShardEntry) -> str:
        """`Keys.shard` of the entry, its version's prefix built once (a batch builds a
        few keys a shard, and each `Keys` call validates every name of the prefix again)."""
        index = entry.index
        if type(index) is not int or index < 0:
            return self.keys.shard(self.tenant, self.model, self.version, index)  # its error
        return f"{self._shards}{index:06d}"

    def _holder_key(self, entry: ShardEntry) -> str:
        """`Keys.holder` of the entry's holder, its version's prefix built once."""
        return f"{self._holders}{validate_name(entry.holder.holder, 'holder')}"

    def what(self, entry: ShardEntry | None = None) -> str:
        if entry is None:
            return f"{self.model}@{self.version}"
        return f"shard {entry.index} of {self.model}@{self.version}"

    def _carry(
        self, state: BatchRead, writing: list[ShardEntry], charged: list[ops.Op], revision: int
    ) -> Carried:
        """What this version's next batch would read right after `writing` committed at
        `revision` on `state`: the counter as written, `latest` as compared (a batch that
        makes the version visible carries nothing), the usage as charged (`charged`: the
        batch's shared puts, the usage's among them), and no shard of its own yet."""
        usage = state.usage
        if self._budget is not None:
            key = ops.b(self._budget.key)
            for op in charged:
                if op.request_put.key == key:
                    usage = ops.KV(key, bytes(op.request_put.value), 0, revision, 0, 0)
        views = tuple(writing[0].view_models) if writing[0].views else ()
        count = state.count or writing[0].count
        return Carried(
            BatchRead(
                state.latest, state.latest_mod, count, state.arrived + len(writing), revision,
                {}, {}, usage, views,
            )
        )  # fmt: skip

    def _read(self, pending: list[ShardEntry], remaining: float) -> BatchRead:
        """latest, the counter, and each pending shard's records, at one revision."""
        gets = [ops.get(self._latest), ops.get(self._arrived)]
        for entry in pending:
            gets += [ops.get(self._shard_key(entry)), ops.get(self._holder_key(entry))]
        if self._budget is not None:
            gets.append(ops.get(self._budget.key))
        result = self.etcd.txn([], gets, timeout=remaining)
        found = [ops.KV.from_pb(r.response_range.kvs[0]) if r.response_range.kvs else None
                 for r in result.responses]  # fmt: skip
        usage = found.pop() if self._budget is not None else None
        latest, arrived = found[0], found[1]
        count, so_far, views = decode_counter(arrived.value if arrived is not None else None)
        self.arrived = max(self.arrived, so_far)
        records = {e.index: kv for e, kv in zip(pending, found[2::2], strict=True) if kv}
        holders = {e.index: kv for e, kv in zip(pending, found[3::2], strict=True) if kv}
        return BatchRead(
            int(latest.value) if latest is not None else 0,
            latest.mod_revision if latest is not None else 0,
            count, so_far,
            arrived.mod_revision if arrived is not None else 0,
            records, holders, usage, views,
        )  # fmt: skip

    def _settle(
        self, pending: list[ShardEntry], state: BatchRead, outcomes: dict[int, Outcome]
    ) -> tuple[list[ShardEntry], list[ShardEntry]]:
        """Decide what the read already decides (our own earlier write, another holder's
        shard, a stale version, a disagreeing shard count); the entries left to write, and
        those that only need to hold a shard already written with their bytes."""
        visible = state.latest >= self.version
        count = state.count
        views = state.views if state.count else None  # the first shard's, once counted
        writing: list[ShardEntry] = []
        rehold: list[ShardEntry] = []
        for entry in pending:
            record = state.records.get(entry.index)
            holder = state.holders.get(entry.index)
            if record is not None:
                if holder is not None and _ours(record, holder, entry):
                    outcomes[id(entry)] = Published(self.version, holder.mod_revision, visible)
                    self._found.add(id(entry))
                elif _same_shard(record, entry):
                    rehold.append(entry)  # its rank again, under a new session
                else:
                    outcomes[id(entry)] = AlreadyExists(
                        f"{self.what(entry)} was already published by another holder"
                    )
            elif state.latest >= self.version:
                outcomes[id(entry)] = StaleVersion(
                    f"{self.model}@{self.version} is not newer than latest "
                    f"{self.model}@{state.latest}"
                )
            elif count and entry.count != count:
                outcomes[id(entry)] = InvalidArgument(
                    f"shard {entry.index} says {self.what()} has {entry.count} shards; "
                    f"the shards published before it say {count}"
                )
            elif views is not None and tuple(entry.view_models) != views:
                outcomes[id(entry)] = InvalidArgument(
                    f"shard {entry.index} of {self.what()} has views {entry.view_models}; "
                    f"the shards published before it have {list(views)}: every shard of a "
                    "version carries the same views"
                )
            else:
                count = count or entry.count
                views = tuple(entry.view_models)
                writing.append(entry)
        return writing, rehold


def _ours(record: ops.KV, holder: ops.KV, entry: ShardEntry) -> bool:
    """Whether a shard record and holder record read back are the entry's own earlier
    write: its shard as it would write it, held under its session."""
    if holder.lease != entry.holder.session or not _same_shard(record, entry):
        return False
    return HolderRecord.decode(holder.value).shard == entry.index


def _same_shard(record: ops.KV, entry: ShardEntry) -> bool:
    """Whether a shard record already written is the entry's shard as it would write it:
    the same holder name, shard count and manifest (size and SHA-256)."""
    written = ShardRecord.decode(record.value)
    mine = entry.staged.header
    return (
        written.holder == entry.holder.holder
        and written.count == entry.count
        and written.part.size == mine.size
        and written.part.digest == mine.digest
    )
