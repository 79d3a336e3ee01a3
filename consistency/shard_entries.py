"""A shard waiting for its batch, and how a batch is taken from the queue of them.

Group commit (`consistency.shard_commit`) puts the shards of one version that wait at the
same moment into one etcd transaction. What fits one is decided here: etcd's operation limit
(`MAX_TXN_OPS`) and what each shard adds to it (`ShardEntry.ops`, its views' `ViewShard.ops`,
its other puts weighed by their bytes), a pack's bytes, one entry per shard index (`take`).
Apart from the committer because these are values and arithmetic on them, with no etcd call:
the hub's queues (`ros.hub.shard_publish`) and the limits' users import them alone.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

from consistency import manifest_packs, ops
from consistency.manifests import Staged
from consistency.publishing import Published
from consistency.records import HolderRecord
from tensorhub.errors import TensorHubError

MAX_TXN_OPS = 128  # etcd's default --max-txn-ops, which we never ask an operator to raise
FIXED_OPS = 5  # per batch: the counter, the usage, the model fence, `latest`, the header
MAX_BATCH = (MAX_TXN_OPS - 3) // 2  # the opening read: 2 gets per shard, 3 for the batch
MIN_OPS = 2  # the fewest operations a shard adds to a batch (`ShardEntry.ops`)
EXTRA_OP_BYTES = 8 * 1024
"""A shard's other puts (`ShardEntry.extra`: its parts of publisher checksums) count as one
more operation of its batch per this many bytes of their values, so the operation limit
also bounds a batch's bytes of them (128 such: 1 MiB, under etcd's 1.5 MiB request)."""
PACK_BYTES = manifest_packs.PACK_BYTES  # a batch's packed manifests, at most
FULL_BATCH = (MAX_TXN_OPS - FIXED_OPS - 1) // 2  # shards of a batch with a pack (61), at most


@dataclass
class ViewShard:
    """A shard's part of one view of its version: the view model, its manifest staged under
    the rank's lease (pages only for a manifest too large to be inline) and its record."""

    model: str
    staged: Staged
    record: bytes

    @property
    def ops(self) -> int:
        """Its puts in a batch: its record, its holder record and its pages' commits."""
        return 2 + self.staged.header.pages


@dataclass
class ShardEntry:
    """One rank's shard publish, staged (its pages, if any, written under its lease) and
    waiting for a batch. `size` is what the tenant's budget is charged for it. `record`: its
    shard record as written, or `b""` for a packed one (`packed` set), whose record names
    its batch's pack and is made by the batch (`ShardCommitter._pack`)."""

    index: int
    count: int
    holder: HolderRecord
    staged: Staged
    record: bytes
    size: int
    deadline: float
    session_key: str = ""  # the session's mark that must exist (a hub: the tenant's own)
    ambiguous: bool = field(default=False, compare=False)
    packed: bytes = field(default=b"", repr=False)  # its manifest for the batch's pack
    views: list[ViewShard] = field(default_factory=list)  # its shards of the version's views
    extra: list[ops.Op] = field(default_factory=list)  # its other puts (publisher parts)
    extra_bytes: int = 0  # their values' bytes (`EXTRA_OP_BYTES`)

    @property
    def ops(self) -> int:
        """The operations this shard adds to a batch's largest list (its puts and its view
        shards', its other puts weighed by their bytes; the pack its manifest goes in is
        the batch's one more)."""
        own = 2 + self.staged.header.pages + len(self.extra) + self.extra_bytes // EXTRA_OP_BYTES
        return own + sum(view.ops for view in self.views) if self.views else own

    @property
    def view_models(self) -> list[str]:
        return [view.model for view in self.views]


Outcome = Published | TensorHubError


def take(queue: list[ShardEntry]) -> list[ShardEntry]:
    """The next batch from `queue`, oldest first, within etcd's operation limit (a pack is
    one operation more) and `PACK_BYTES` of packed manifests, with at most one entry per
    shard index (a second publish of an index waits for the next batch, where it finds the
    first one's record). Removes what it takes from `queue`. The scan stops where the batch
    is full (`MAX_BATCH` entries, or no room for the smallest entry's `MIN_OPS`): a burst
    queues thousands of shards, and each batch looks at about its own."""
    batch: list[ShardEntry] = []
    indices: set[int] = set()
    used = FIXED_OPS + view_ops(queue)
    packed = 0
    rest: list[ShardEntry] = []
    for at, entry in enumerate(queue):
        if len(batch) >= MAX_BATCH or used + MIN_OPS > MAX_TXN_OPS:
            rest += queue[at:]  # nothing more fits: the rest stays, in order
            break
        more = entry.ops + (1 if entry.packed and not packed else 0)
        if (
            len(batch) < MAX_BATCH
            and entry.index not in indices
            and used + more <= MAX_TXN_OPS
            and (not entry.packed or packed + len(entry.packed) <= PACK_BYTES)
        ):
            batch.append(entry)
            indices.add(entry.index)
            used += more
            packed += len(entry.packed)
        else:
            rest.append(entry)
    queue[:] = rest
    return batch


def view_ops(entries: Sequence[ShardEntry]) -> int:
    """The operations a batch of `entries` may add for its views beyond each entry's own:
    each view's header and `latest`, in the batch that completes the version."""
    return 2 * max(map(len, map(_views_of, entries)), default=0)  # in C: bursts queue thousands


_views_of = operator.attrgetter("views")
