"""Per-tenant etcd budget: the live manifest bytes a tenant holds, and its publish rate.

etcd refuses every write of every tenant once its database reaches its quota (NOSPACE), so
one tenant publishing big manifests could take writes away from all of them. Each tenant
therefore has one usage key (`Keys.quota_fence(tenant, "usage")`) holding

- `bytes`: the manifest bytes (plus `RECORD_BYTES` per version or shard record) of the
  tenant's versions that etcd holds now, and its layout block sets' keys (below): charged by
  the write that creates them, released by the transaction that deletes them (retention,
  model deletion);
- `tokens` and `at`: a token bucket of publishes, refilled at `publishes_per_minute / 60`
  per second up to `publishes_per_minute`. A whole version's publish takes one token; a
  model-parallel version of N shards takes ceil(N / `SHARDS_PER_TOKEN`) in all, one for each
  shard whose arrival (0, 1, 2, ... in the order its version's batches count them) is a
  multiple of `SHARDS_PER_TOKEN` (`shard_tokens`). So a version costs the same whether its
  shards come one call per rank or all in one call, and a caller that publishes one shard
  of each of many versions pays a token for each: a shard's share of its version is never
  less than 1 / `SHARDS_PER_TOKEN` of a publish, whatever shard count it claims;
- `history`: a bucket of the bytes the tenant's publishes may write into etcd's history
  (`history_cost`: a paged manifest is written twice, plus its records), refilled at
  `history_bytes` per `history_period` (the compactor's interval) up to `history_bytes`.
  Live bytes are only what etcd keeps after compaction; every rewrite in between stays in
  the database until the compactor's next pass, so tenants each inside their live budget
  could together fill etcd between two compactions. The bucket bounds what one tenant can
  write in any one interval to twice `history_bytes`, whatever its publish rate.

A publish adds `charge`'s compare and put to its own transaction: the compare is on the
usage key's mod_revision as read, so two publishes that both read the same usage cannot both
commit (the loser retries, re-reading it), and the budget holds across every hub replica
with no state of their own. Past either limit the publish fails with `QuotaExceeded` before
it writes (`charge` is also asked once before the manifest is staged). The cost: two
publishes of one tenant that read the same usage cannot both commit, so the loser reads again
and retries. The shards of one version are charged once per batch (`charge_many`,
`consistency.shard_commit`), so a burst of thousands of ranks costs one charge per
transaction, not one contended charge per shard; different models of a tenant retry each
other's compares only when they commit at the same instant (no lock serializes them).

A replica keeps the usage keys as it last read or wrote them (`UsageCache`): a publish
charges against the cached value, compares its mod_revision as ever, and reads the key
again only after a transaction that failed (or whose outcome is unknown). Another
replica's charge in between only fails that compare, so the cache costs no guarantee, and
a steady publisher reads its usage once, not twice per publish.

A layout block set's key (`consistency.layouts`: a reader in another layout's description
and checksums of its blocks, up to about 768 KiB, no lease's) is charged the same way by the
registration that creates it: its value's length plus `RECORD_BYTES`, live and in the
history bucket, no token, with the same compare on the usage key's mod_revision, in the
transaction that creates it. The version's tally (`consistency.layout_tally`) records what
was charged, and the releases read it with the version's keys: `release_version` the
version's tally, `release_models` a model's tallies (one range, one key per version).

Holder, pin and session records are not charged here: they are small, bounded in size, and
bounded in number by the session quota (each lives under its session's lease).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from etcd3 import etcdrpc

from consistency import ops
from consistency.etcd import Etcd
from consistency.keys import Keys
from consistency.layout_tally import LayoutTally
from consistency.records import PartHeader, ShardRecord
from tensorhub.errors import QuotaExceeded
from tensorhub.lru import SizedLru

RECORD_BYTES = 1024  # charged per version header or shard record beside its manifest bytes
SHARDS_PER_TOKEN = 8  # K: a version of N shards takes ceil(N / K) publish-rate tokens
DEFAULT_HISTORY_PERIOD = 300.0  # the compactor's default interval (consistency.compactor)
Guard = tuple[list[ops.Cmp], list[ops.Op]]


@dataclass(frozen=True)
class Usage:
    """One tenant's usage as stored (see the module docstring)."""

    held: int = 0  # bytes
    tokens: float = -1.0  # -1: never published (a full bucket)
    at: float = 0.0
    history: float = -1.0  # history bytes left in its bucket; -1: a full bucket

    def encode(self) -> bytes:
        return json.dumps(
            {"bytes": self.held, "tokens": self.tokens, "at": self.at, "history": self.history}
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Usage:
        data = json.loads(raw)
        return cls(
            int(data["bytes"]),
            float(data["tokens"]),
            float(data["at"]),
            float(data.get("history", -1.0)),  # a usage written before the history budget
        )


def shard_tokens(first: int, count: int) -> int:
    """The publish-rate tokens taken by `count` shards of one version arriving as its
    shards number `first` .. `first + count - 1` (arrival order, from 0): one per arrival
    that is a multiple of `SHARDS_PER_TOKEN`. A version of N shards takes `shard_tokens(0,
    N)` = ceil(N / `SHARDS_PER_TOKEN`) however its arrivals are split between calls or
    batches (one rank per call, or a group call of all of them), since the ranges they
    cover add up to 0 .. N - 1."""
    if count <= 0:
        return 0
    return _multiples_below(first + count) - _multiples_below(first)


def _multiples_below(n: int) -> int:
    """How many of 0 .. n - 1 are multiples of `SHARDS_PER_TOKEN`: ceil(n / K)."""
    return -(-n // SHARDS_PER_TOKEN)


def history_cost(nbytes: int, inline: int) -> int:
    """What a publish of an `nbytes` manifest writes into etcd's history, beside the live
    bytes: a manifest over `inline` bytes is written twice (its pages under the lease, then
    re-put detached in the publish transaction: two revisions until compaction), plus
    `RECORD_BYTES` for the header or shard record, holder record, `latest` and the usage."""
    return nbytes * (2 if nbytes > inline else 1) + RECORD_BYTES


class UsageCache:
    """The usage keys as this replica last read or wrote them (see the module docstring):
    at most `limit` bytes of them; a key cached as absent has mod_revision 0."""

    def __init__(self, limit: int = 4 << 20) -> None:
        self._kvs: SizedLru[bytes, ops.KV] = SizedLru(limit, lambda kv: len(kv.key) + len(kv.value))

    def get(self, key: str) -> ops.KV | Missing | None:
        """The cached usage (None: known absent), or `MISSING` if not cached."""
        kv = self._kvs.get(ops.b(key))
        if kv is None:
            return MISSING
        return kv if kv.mod_revision else None

    def put(self, key: str, kv: ops.KV | None) -> None:
        self._kvs.put(ops.b(key), kv or ops.KV(ops.b(key), b"", 0, 0, 0, 0))

    def drop(self, key: str) -> None:
        self._kvs.pop(ops.b(key))

    def remember(self, puts: Sequence[ops.Op], revision: int) -> None:
        """Cache the usage that `puts` (a release's, `release_version`) wrote at `revision`."""
        for op in puts:
            put = op.request_put
            key = bytes(put.key)
            self._kvs.put(key, ops.KV(key, bytes(put.value), 0, revision, 0, 0))


class Missing:
    """`UsageCache.get`'s answer for a key it does not hold."""


MISSING = Missing()


class TenantBudget:
    """The usage key of one tenant against its limits, `max_bytes` and
    `publishes_per_minute`; `clock` is wall time (replicas share the bucket, so it is the
    one clock they roughly agree on)."""

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        tenant: str,
        *,
        max_bytes: int,
        publishes_per_minute: int,
        history_bytes: int | None = None,
        history_period: float = DEFAULT_HISTORY_PERIOD,
        inline: int = 64 << 10,
        clock: Callable[[], float] = time.time,
        cache: UsageCache | None = None,
    ) -> None:
        """`history_bytes` (None: `max_bytes`) of etcd history per `history_period` (the
        compactor's interval) refill a bucket of that size; `inline`: the manifest size up
        to which a publish writes its manifest once (`history_cost`); `cache`: the
        replica's usage cache, which `charge` reads first and keeps up to date."""
        self._etcd = etcd
        self.key = keys.quota_fence(tenant, "usage")
        self._tenant = tenant
        self._max_bytes = max_bytes
        self._rate = publishes_per_minute
        self._history = history_bytes if history_bytes is not None else max_bytes
        self._history_period = history_period
        self._inline = inline
        self._clock = clock
        self._cache = cache
        self.written = b""  # the usage the last charge puts (`committed` caches it)

    def charge_for(self, nbytes: int, publishes: float) -> UsageCharge:
        """The `consistency.publishing.Charge` of one publish of an `nbytes` manifest,
        against the cached usage while its transactions commit (module docstring)."""
        return UsageCharge(self, nbytes, publishes)

    def charge(self, nbytes: int, publishes: float, timeout: float) -> Guard:
        """The compare and put that charge a publish in its transaction, or `QuotaExceeded`.
        Call again (a fresh read) after the transaction fails."""
        admitted, compares, puts, refusal = self.charge_many([nbytes], timeout, publishes)
        if not admitted:
            assert refusal is not None  # charge_many names why it admitted nothing
            raise refusal
        return compares, puts

    def charge_many(
        self, sizes: Sequence[int], timeout: float, publishes: float | Sequence[float] = 1.0
    ) -> tuple[int, list[ops.Cmp], list[ops.Op], QuotaExceeded | None]:
        """Charge a batch of publishes (`sizes`: each one's manifest bytes; `publishes`:
        the tokens each takes, the same for all or one per entry) in one compare and put,
        after one read: how many of them, in order, fit; the compare and put that charge
        those; and the refusal for the rest (None if all fit). Call again (a fresh read)
        after the transaction fails."""
        kv, _ = self._etcd.get(self.key, timeout=timeout)
        return self.charge_read(sizes, kv, publishes)

    def charge_read(
        self,
        sizes: Sequence[int],
        kv: ops.KV | None,
        publishes: float | Sequence[float] = 1.0,
    ) -> tuple[int, list[ops.Cmp], list[ops.Op], QuotaExceeded | None]:
        """`charge_many` against the usage key as the caller read it (`kv`; None: it does
        not exist), with no read of its own (`consistency.shard_guards.Budget`)."""
        costs = (
            [float(publishes)] * len(sizes)
            if isinstance(publishes, int | float)
            else [float(p) for p in publishes]
        )
        usage = Usage.decode(kv.value) if kv is not None else Usage()
        now = self._clock()
        elapsed = max(0.0, now - usage.at)
        tokens = float(self._rate) if usage.tokens < 0 else usage.tokens
        tokens = min(float(self._rate), tokens + elapsed * self._rate / 60.0)
        capacity = float(self._history)
        history = capacity if usage.history < 0 else usage.history
        history = min(capacity, history + elapsed * capacity / self._history_period)
        held = usage.held
        admitted = 0
        refusal: QuotaExceeded | None = None
        for nbytes, cost in zip(sizes, costs, strict=True):
            written = history_cost(nbytes, self._inline)
            if written > history + 1e-6:
                refusal = QuotaExceeded(
                    f"tenant {self._tenant} wrote its etcd history budget of "
                    f"{self._history} bytes per {self._history_period:g} s "
                    f"(max_history_bytes); this publish writes {written}: retry later"
                )
                break
            charged = nbytes + RECORD_BYTES
            if held + charged > self._max_bytes:
                refusal = QuotaExceeded(
                    f"tenant {self._tenant} holds {held} bytes in etcd; {charged} more "
                    f"would pass its quota of {self._max_bytes} (max_etcd_bytes)"
                )
                break
            if tokens < cost - 1e-9:
                refusal = QuotaExceeded(
                    f"tenant {self._tenant} publishes faster than its quota of {self._rate} "
                    "per minute (max_publishes_per_minute): retry later"
                )
                break
            held += charged
            tokens -= cost
            history -= written
            admitted += 1
        if not admitted:
            return 0, [], [], refusal
        after = Usage(held, tokens, now, history)
        seen = kv.mod_revision if kv is not None else 0
        self.written = after.encode()
        return (
            admitted,
            [ops.mod(self.key, "==", seen)],
            [ops.put(self.key, self.written)],
            refusal,
        )

    def cached_charge(self, nbytes: int, publishes: float, timeout: float) -> Guard:
        """`charge` against the cached usage when there is one and it admits the publish (no
        read); else it reads the key, caches what it read, and decides on that."""
        cache = self._cache
        kv: ops.KV | Missing | None = MISSING if cache is None else cache.get(self.key)
        if not isinstance(kv, Missing):
            admitted, compares, puts, _ = self.charge_read([nbytes], kv, publishes)
            if admitted:
                return compares, puts
            # A refusal is never taken from the cache: a release (a model deleted, another
            # replica's retention) may have given bytes back since. Read, and decide again.
        kv, _ = self._etcd.get(self.key, timeout=timeout)
        if cache is not None:
            cache.put(self.key, kv)
        admitted, compares, puts, refusal = self.charge_read([nbytes], kv, publishes)
        if not admitted:
            assert refusal is not None
            raise refusal
        return compares, puts

    def committed(self, revision: int | None) -> None:
        """After the transaction that carried the last charge: cache what it wrote, at
        `revision`; or (None: it failed, or its outcome is unknown) forget the key, so that
        the next charge reads it again."""
        if self._cache is None:
            return
        if revision is None:
            self._cache.drop(self.key)
            return
        self._cache.put(self.key, ops.KV(ops.b(self.key), self.written, 0, revision, 0, 0))


class UsageCharge:
    """One publish's charge (`consistency.publishing.Charge`): the budget's compare and put
    for each attempt, against the replica's cached usage, kept up to date by `settle`."""

    def __init__(self, budget: TenantBudget, nbytes: int, publishes: float) -> None:
        self._budget, self._nbytes, self._publishes = budget, nbytes, publishes

    def __call__(self, timeout: float) -> Guard:
        return self._budget.cached_charge(self._nbytes, self._publishes, timeout)

    def settle(self, revision: int | None) -> None:
        self._budget.committed(revision)


def release_version(
    etcd: Etcd, keys: Keys, tenant: str, model: str, version: int, timeout: float | None
) -> Guard:
    """The compare and put that give back what `model@version` was charged, in the
    transaction that deletes it. The charge (its header and shard records, and its layout
    block sets as its tally records them) and the usage key
    are read in one read-only transaction, at one revision, and the usage key's mod revision
    is compared: a publish, a model deletion or another replica's retention that changed
    either since fails the compare, and the caller calls again. So no charge is given back
    twice, and none that landed between two reads is missed. Retry with a fresh call after
    the transaction fails."""
    key = keys.quota_fence(tenant, "usage")
    result = etcd.txn(
        [],
        [
            ops.get(keys.manifest(tenant, model, version)),
            ops.get(keys.shards(tenant, model, version), prefix=True),
            ops.get(keys.layout_charge(tenant, model, version)),
            ops.get(key),
        ],
        timeout=timeout,
    )
    top, shards, tally, held = (r.response_range.kvs for r in result.responses)
    charged = (
        sum(_charge("manifest", bytes(kv.value)) for kv in top)
        + sum(_charge("shard", bytes(kv.value)) for kv in shards)
        + layouts_charge(tally)
    )
    return _released(key, held, charged)


def release_model(etcd: Etcd, keys: Keys, tenant: str, model: str, timeout: float | None) -> Guard:
    """`release_version` for every version of `model` (one range read of its version keys,
    with the usage key, at one revision): for the transaction that deletes the whole model."""
    return release_models(etcd, keys, tenant, [model], timeout)


def release_models(
    etcd: Etcd, keys: Keys, tenant: str, models: Sequence[str], timeout: float | None
) -> Guard:
    """`release_model` for several models at one revision (a model with its views)."""
    key = keys.quota_fence(tenant, "usage")
    listings = []
    for model in models:
        versions = keys.versions(tenant, model)
        listing = etcdrpc.RangeRequest(key=ops.b(versions), range_end=ops.prefix_end(versions))
        listings.append(etcdrpc.RequestOp(request_range=listing))
        listings.append(ops.get(keys.layout_charges(tenant, model), prefix=True))
    result = etcd.txn([], [*listings, ops.get(key)], timeout=timeout)
    *listed, held = (r.response_range.kvs for r in result.responses)
    pairs = zip(models, listed[::2], strict=True)
    charged = sum(versions_charge(keys, tenant, m, kvs) for m, kvs in pairs)
    charged += sum(layouts_charge(tallies) for tallies in listed[1::2])
    return _released(key, held, charged)


def layouts_charge(tallies: Iterable[Any]) -> int:
    """What the layout tally keys `tallies` (as read, each with its `value`) were charged:
    the block sets their versions' readers recorded (`consistency.layout_tally`)."""
    return sum(LayoutTally.decode(bytes(kv.value)).charged for kv in tallies)


def versions_charge(keys: Keys, tenant: str, model: str, kvs: Iterable[Any]) -> int:
    """What the version keys `kvs` of `model` (as read, each with `key` and `value`) were
    charged: its whole versions' headers and its shard records."""
    total = 0
    for kv in kvs:
        _, kind, _ = keys.parse_version_key(tenant, model, bytes(kv.key).decode())
        total += _charge(kind, bytes(kv.value))
    return total


def _released(key: str, held: Sequence[Any], nbytes: int) -> Guard:
    """The compare (the usage key as read) and the put (`nbytes` less) of a release;
    nothing to put if the tenant has no usage key (its versions predate the budget)."""
    if not held:
        return [ops.absent(key)], []
    usage = Usage.decode(bytes(held[0].value))
    after = Usage(max(0, usage.held - nbytes), usage.tokens, usage.at, usage.history)
    return [ops.mod(key, "==", int(held[0].mod_revision))], [ops.put(key, after.encode())]


def _charge(kind: str, value: bytes) -> int:
    """The charge of one version key: a whole version's header or a shard record (the
    header of a model-parallel version is not charged: its shards are)."""
    if kind == "shard":
        return ShardRecord.decode(value).part.size + RECORD_BYTES
    if kind == "manifest":
        head = PartHeader.decode(value)
        return 0 if head.shards else head.size + RECORD_BYTES
    return 0
