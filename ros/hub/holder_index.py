"""A replica's in-memory index of live holder records, so that Resolve costs O(K log N).

Each replica keeps, per (tenant, model), the live holder records of its versions, fed by the
model's one etcd watch on this replica (`ros.hub.model_feed`: the same watch serves the
model's Watch streams), after one range read (started on first use, dropped after
`IDLE_SECONDS` unused; at most `MAX_MODELS` models, least recently used dropped first). An
indexed model costs no thread of its own.

Per version (per shard of a model-parallel version) the records are grouped by topology
(same host, rack, dc, anywhere: the tiers of `transport.planner`), and within each group
kept sorted by fence (create revision), complete holders apart from partial ones. A query
(`ros.hub.candidates.select_candidates`) then walks a few sorted runs: O(K log N) for K answers.
The hub keeps no load state of its own: only what the records say.

Freshness (`ModelIndex.wait_for`): like Kubernetes' consistent reads from its watch cache.
The index knows the revision it is current at (every event up to it applied). A query with a
revision floor the index has not reached asks etcd for a progress notification on the
replica's watch stream and waits for it, bounded (`FRESH_WAIT`); the caller falls back to a
direct etcd read when that fails.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from consistency import Etcd, Keys
from consistency.holder_view import MANIFEST, ModelHolders, ModelRead
from consistency.ops import KV
from consistency.records import HolderRecord
from consistency.watch_mux import Progress, RawEvent, Resync
from ros.hub.candidates import MAX_CANDIDATES, HolderSet, select_candidates
from ros.hub.model_feed import Feed, ModelFeeds
from ros.metrics import HUB_INDEXED_MODELS, HUB_RESOLVE_READS
from tensorhub.errors import InvalidArgument, TensorHubError, Unavailable

log = logging.getLogger(__name__)

MAX_MODELS = 256  # models indexed per replica (each: one etcd watch, shared; no thread)
IDLE_SECONDS = 300.0  # an index unused this long is dropped (its watch closed)
FRESH_WAIT = 1.0  # how long a query waits for the index to reach its revision floor


@dataclass(frozen=True)
class Lookup:
    """What the index says about one version at `revision`."""

    published: int  # create revision of the version's manifest key (0: not published)
    candidates: list[HolderRecord]
    total: int  # live holders of the part asked
    revision: int
    total_all: int = 0  # live holders of every part of the version


class _Version:
    """One version's state in the index: published (the create revision of its manifest
    key, 0 while it has none: a version deleted and published again is told apart) and its
    holders."""

    __slots__ = ("part_of", "parts", "published")

    def __init__(self) -> None:
        self.published = 0
        self.parts: dict[int | None, HolderSet] = {}
        self.part_of: dict[str, int | None] = {}

    def put(self, record: HolderRecord) -> None:
        old = self.part_of.get(record.holder, record.shard)
        if old != record.shard:
            self.parts[old].remove(record.holder)
        self.part_of[record.holder] = record.shard
        self.parts.setdefault(record.shard, HolderSet()).put(record)

    def remove(self, name: str) -> None:
        if name in self.part_of:
            self.parts[self.part_of.pop(name)].remove(name)

    @property
    def empty(self) -> bool:
        return not self.published and not self.part_of


class ModelIndex:
    """The live holders of one model's versions, current at `revision`, fed by the model's
    feed (`ros.hub.model_feed`). Constructing it does no I/O: `open` reads and attaches."""

    def __init__(self, records: ModelHolders) -> None:
        self.tenant, self.model = records.tenant, records.model
        self._records = records
        self._cond = threading.Condition()
        self._versions: dict[int, _Version] = {}
        self._notified = 0  # the last progress notification, confirmed by the next
        self.failed: BaseException | None = None
        self.last_used = time.monotonic()
        self.revision = 0
        self._read_at = 0  # the revision `open` read the model at
        self._loading: list[RawEvent | Resync] | None = None  # items fed while it reads
        self._feeds: ModelFeeds | None = None
        self._feed: Feed | None = None

    def open(self, feeds: ModelFeeds) -> ModelIndex:
        """Read the model, attach to its feed, and meet: the index is read at the revision
        the feed has delivered through (read again at that revision if the feed was ahead
        of the first read), and every item after it is applied. Returns self."""
        loaded = self._load(0)
        with self._cond:
            self._loading = []
        prefix = self._records.prefix
        feed = feeds.join(self.tenant, self.model, prefix, self, loaded + 1, exact=False)
        assert feed is not None  # only an exact join is refused
        self._feeds, self._feed = feeds, feed
        with feed.lock:
            through = feed.delivered_through
        try:
            if through > loaded:  # the feed was ahead of the read: read again where it is
                with self._cond:
                    self._versions.clear()
                loaded = self._load(through)
        except BaseException:
            self.close()
            raise
        with self._cond:
            self.revision = self._read_at = loaded
            fed, self._loading = self._loading or [], None
            for item in fed:
                self._take(item)
            self._cond.notify_all()
        return self

    # -- queries ---------------------------------------------------------------------------

    def wait_for(self, revision: int, timeout: float) -> bool:
        """Whether the index has applied every event up to `revision`, waiting up to
        `timeout` s for it: asks etcd for progress notifications meanwhile (outside the
        index's lock: the feed delivers under its own lock, then takes the index's)."""
        deadline = time.monotonic() + timeout
        asked = 0.0
        with self._cond:
            notified = self._notified
        while True:
            with self._cond:
                while True:
                    if self.revision >= revision:
                        return True
                    now = time.monotonic()
                    if now >= deadline or self.failed is not None:
                        return False
                    if now - asked >= 0.05 or self._notified != notified:
                        # again at once after a notification: it counts when the next comes
                        notified, asked = self._notified, now
                        break
                    self._cond.wait(min(deadline - now, 0.05))
            if self._feeds is not None:
                self._feeds.request_progress()

    def lookup(
        self,
        version: int,
        part: int | None,
        *,
        topology: Mapping[str, str],
        fence: int = 0,
        exclude: str = "",
        k: int = MAX_CANDIDATES,
    ) -> Lookup:
        """Candidates among the holders of `version` (of shard `part`), at the index's
        current revision."""
        self.last_used = time.monotonic()
        with self._cond:
            state = self._versions.get(version)
            if state is None:
                return Lookup(0, [], 0, self.revision)
            holders = state.parts.get(part) or HolderSet()
            chosen = select_candidates(holders, topology, fence, exclude, k)
            total_all = sum(len(p) for p in state.parts.values())
            return Lookup(state.published, chosen, len(holders), self.revision, total_all)

    def close(self) -> None:
        """Leave the model's feed (its etcd watch is cancelled if nothing else uses it)."""
        if self._feeds is not None and self._feed is not None:
            self._feeds.leave(self._feed, self)

    # -- feeding (on the mux's thread, under the feed's lock) -----------------------------

    def deliver(self, items: Sequence[RawEvent | Resync]) -> None:
        """Apply a batch of the model's etcd items (kept aside while the index reads)."""
        with self._cond:
            if self._loading is not None:
                self._loading.extend(items)
                return
            for item in items:
                self._take(item)
            self._cond.notify_all()

    def progress(self, revision: int) -> None:
        """etcd's progress notification for the model's watch (see `_apply`)."""
        with self._cond:
            if self._loading is None:
                self._apply(Progress(revision, notified=True))
                self._cond.notify_all()

    def fail(self, error: TensorHubError) -> None:
        """The model's watch ended: recorded, so queries fall back to etcd and the replica
        indexes the model anew on its next use."""
        log.warning("holder index of %s/%s failed: %s", self.tenant, self.model, error)
        with self._cond:
            self.failed = error
            self._cond.notify_all()

    def _take(self, item: RawEvent | Resync) -> None:
        """Apply one item unless what the index read already holds it."""
        if item.revision > self._read_at:
            self._apply(item)
            self.revision = max(self.revision, item.revision)

    def _load(self, at: int) -> int:
        """The model read at revision `at` (0: now; `ModelHolders.read`) as the index's
        versions; returns the revision it was read at."""
        read: ModelRead = self._records.read(at)
        versions: dict[int, _Version] = {}
        for number, published in read.published.items():
            versions.setdefault(number, _Version()).published = published
        for number, records in read.holders.items():
            for record in records:
                versions.setdefault(number, _Version()).put(record)
        with self._cond:
            self._versions = versions
        return read.revision

    def _apply(self, item: RawEvent | Resync | Progress) -> None:
        if isinstance(item, Progress):
            # A notification counts once the next one arrives: on etcd releases before
            # etcd-io/etcd#15220's fix it could overtake events still being sent.
            self.revision = max(self.revision, min(self._notified, item.revision))
            self._notified = item.revision
            return
        if isinstance(item, Resync):
            self._versions.clear()
            for kv in item.kvs:
                self._event(False, kv)
            self.revision = item.revision
            return
        self._event(item.deleted, item.kv)

    def _event(self, deleted: bool, kv: KV) -> None:
        try:
            change = self._records.change(kv, deleted)
        except InvalidArgument as exc:
            log.warning("skipping malformed holder record %s: %s", kv.key.decode(), exc)
            return
        if change is None:
            return
        state = self._version(change.version)
        if change.kind == MANIFEST:
            state.published = change.published
        elif change.record is None:
            state.remove(change.name)
        else:
            state.put(change.record)
        if state.empty:
            del self._versions[change.version]

    def _version(self, version: int) -> _Version:
        state = self._versions.get(version)
        if state is None:
            state = self._versions[version] = _Version()
        return state


class HolderIndex:
    """The replica's model indexes, created on first use, bounded (LRU) and dropped idle.

    `feeds`: the replica's model feeds, shared with its Watch fan-out (one of its own when
    not given)."""

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        *,
        max_models: int = MAX_MODELS,
        idle_seconds: float = IDLE_SECONDS,
        feeds: ModelFeeds | None = None,
    ) -> None:
        self._etcd, self._keys = etcd, keys
        self._own_feeds = feeds is None
        self._feeds = feeds or ModelFeeds(etcd)
        self._max_models, self._idle = max_models, idle_seconds
        self._lock = threading.Lock()
        self._models: OrderedDict[tuple[str, str], ModelIndex] = OrderedDict()
        self._closed = False

    def fresh(self, tenant: str, model: str, revision: int, timeout: float) -> ModelIndex | None:
        """The model's index once it is current at `revision` or later (waiting at most
        `timeout` s, bounded by `FRESH_WAIT`); None if it cannot be (fall back to etcd)."""
        try:
            index = self._get(tenant, model)
        except TensorHubError as exc:
            log.info("no holder index for %s/%s: %s", tenant, model, exc)
            return None
        if index.wait_for(revision, min(timeout, FRESH_WAIT)):
            return index
        return None

    def candidates(
        self,
        tenant: str,
        model: str,
        version: int,
        part: int | None,
        *,
        min_revision: int,
        timeout: float,
        topology: Mapping[str, str],
        fence: int = 0,
        exclude: str = "",
    ) -> Lookup:
        """`select_candidates` over the holders of `version` (of shard `part`), from a view
        at `min_revision` or later: the index when it is (or gets, within `FRESH_WAIT`)
        that current and knows the version, else one direct etcd read of the version's
        holders. `VersionNotFound` if the version is not published."""
        index = self.fresh(tenant, model, min_revision, timeout)
        if index is not None:
            found = index.lookup(version, part, topology=topology, fence=fence, exclude=exclude)
            if found.published:
                return found
        HUB_RESOLVE_READS.labels("behind" if index is None else "unknown_version").inc()
        return self._read(tenant, model, version, part, timeout, topology, fence, exclude)

    def _read(
        self,
        tenant: str,
        model: str,
        version: int,
        part: int | None,
        timeout: float,
        topology: Mapping[str, str],
        fence: int,
        exclude: str,
    ) -> Lookup:
        """The fallback: the version's holder records read from etcd (O(N), rare)."""
        read = ModelHolders(self._etcd, self._keys, tenant, model).read_version(version, timeout)
        state = _Version()
        for record in read.records:
            state.put(record)
        holders = state.parts.get(part) or HolderSet()
        chosen = select_candidates(holders, topology, fence, exclude)
        return Lookup(read.published, chosen, len(holders), read.revision, len(read.records))

    def _get(self, tenant: str, model: str) -> ModelIndex:
        key = (tenant, model)
        stale: list[ModelIndex] = []
        with self._lock:
            index = self._models.get(key)
            if index is not None and index.failed is None:
                self._models.move_to_end(key)
                index.last_used = time.monotonic()
                stale = self._evictions(key)
            elif index is not None:
                stale.append(self._models.pop(key))
                index = None
        for old in stale:
            old.close()
        if index is not None:
            return index
        records = ModelHolders(self._etcd, self._keys, tenant, model)
        created = ModelIndex(records).open(self._feeds)  # no lock
        with self._lock:
            current = self._models.get(key)
            if self._closed or (current is not None and current.failed is None):
                stale = [created]
                result = current
            else:
                self._models[key] = created
                result = created
                stale = self._evictions(key)
        for old in stale:
            old.close()
        if result is None:
            raise Unavailable("the holder index is closed")
        return result

    def _evictions(self, keep: tuple[str, str]) -> list[ModelIndex]:
        """Indexes to drop (called with the lock held): past the bound, or idle; never
        `keep` (the one being handed out, the most recently used)."""
        dropped = []
        now = time.monotonic()
        while self._models:
            key, oldest = next(iter(self._models.items()))
            if key == keep:
                break
            if len(self._models) <= self._max_models and now - oldest.last_used < self._idle:
                break
            del self._models[key]
            dropped.append(oldest)
        self._count()
        return dropped

    def __len__(self) -> int:
        with self._lock:
            return len(self._models)

    def _count(self) -> None:
        """Export how many models are indexed (called with the lock held)."""
        HUB_INDEXED_MODELS.set(len(self._models))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            indexes, self._models = list(self._models.values()), OrderedDict()
            self._count()
        for index in indexes:
            index.close()
        if self._own_feeds:
            self._feeds.close()
