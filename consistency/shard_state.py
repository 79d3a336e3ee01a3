"""What a batch of shards knows of its version: the counter decoded, what an attempt read,
and what a committer carries from one batch to the next.

The version's shard counter (`{"count": n, "arrived": k, "views": [...]}`, read and written
by every batch of `consistency.shard_commit`) is decoded here (`decode_counter`), and read
alone by the budget's estimate before a batch (`arrivals`). `BatchRead` is the state an
attempt decides on, read in one transaction or carried (`Carried`) from the version's last
batch on the same committer. Apart from the committer because these are its inputs as
values: the hub keeps `Carried` between batches (`ros.hub.shard_publish`) and its budget
reads `arrivals` without loading the committer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from consistency import ops
from consistency.etcd import Etcd
from consistency.keys import Keys
from tensorhub.errors import InvalidArgument


@dataclass(frozen=True)
class BatchRead:
    """What an attempt read: `latest`, the counter, and each pending shard's own records."""

    latest: int
    latest_mod: int
    count: int  # 0: no shard arrived yet
    arrived: int
    arrived_mod: int
    records: dict[int, ops.KV]  # shard index -> its shard record, where one exists
    holders: dict[int, ops.KV]  # shard index -> the entry's holder record, where one exists
    usage: ops.KV | None = None  # the tenant's usage key, with a budget
    views: tuple[str, ...] = ()  # the view models the counter names


@dataclass(frozen=True)
class Carried:
    """What a version's next batch would read right after its last batch committed on this
    committer (`ShardCommitter.carried`; a hub keeps it from one batch to the next): the
    counter and usage as that batch wrote them, `latest` as it compared it, no shard
    record. The next batch sends its transaction on this state instead of reading first;
    its compares (`latest`, the counter, the usage, each shard's record absent) hold
    exactly when nothing has changed since, and a transaction that fails, or a state that
    would decide a shard alone, sends the batch back to the read."""

    state: BatchRead


def arrivals(etcd: Etcd, keys: Keys, tenant: str, model: str, version: int, timeout: float) -> int:
    """How many shards of `model@version` have committed so far (one read of its
    counter): what a shard checked against the budget before its batch expects to arrive
    after. Only an estimate: the batch's own charge, on the counter it compares, decides."""
    kv, _ = etcd.get(keys.shard_arrivals(tenant, model, version), timeout=timeout)
    return decode_counter(kv.value if kv is not None else None)[1]


def decode_counter(raw: bytes | None) -> tuple[int, int, tuple[str, ...]]:
    """(shard count, shards arrived, view models) from the counter's value; (0, 0, ())
    without one."""
    if raw is None:
        return 0, 0, ()
    try:
        data = json.loads(raw)
        views = tuple(str(v) for v in data.get("views", ()))
        return int(data["count"]), int(data["arrived"]), views
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidArgument(f"unreadable shard counter {raw[:80]!r}") from exc
