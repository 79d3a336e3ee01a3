"""The version registry: publish (single and model-parallel), latest, list, retention.

Publish is one etcd transaction that compares `latest`'s mod_revision with the one read, so
two publishers racing for the same version cannot both win, and `latest` only ever moves up.
A manifest too big for one etcd value is paged first (`consistency.manifests`) and its pages
are committed by the same transaction. Model-parallel ranks' shards are committed in batches
(`consistency.shard_commit`): each batch writes its shards' records and counts them in the
version's counter, and the batch that counts the last shard moves `latest`, so no reader ever
sees a version with missing shards.
Retention keeps the newest N complete versions; older ones are deleted unless a reader has
pinned them. The publish transaction and its retry loop are `consistency.publishing`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace

from consistency import manifest_packs, ops, usage
from consistency.etcd import Etcd
from consistency.keys import Keys
from consistency.manifests import (
    SHARD_INLINE_BYTES,
    ManifestHeader,
    ManifestStore,
    Staged,
    check_manifest_size,
    check_shard_count,
)
from consistency.publishing import DEFAULT_TIMEOUT, Admit, Charge, Published, Publisher
from consistency.records import HolderRecord, HolderState, PartHeader, ShardRecord
from consistency.retry import USAGE_RACES, LostRace
from consistency.shard_commit import ShardCommitter
from consistency.shard_entries import ShardEntry, ViewShard
from consistency.shard_guards import Budget
from consistency.view_publish import StagedViews, ViewsCharge
from tensorhub.errors import InvalidArgument, OutcomeUnknown, TensorHubError
from tensorhub.names import validate_name, validate_version
from tensorhub.view_rules import views_of

__all__ = ["DEFAULT_RETAIN", "VersionInfo", "VersionRegistry"]

log = logging.getLogger(__name__)

DEFAULT_RETAIN = 2


@dataclass(frozen=True)
class VersionInfo:
    """One version as read at `revision`: its manifest (or shard parts), holders and pins."""

    version: int
    manifest: bytes
    shards: list[ShardRecord]
    holders: list[HolderRecord]
    pins: list[str]
    revision: int
    latest: int = 0
    retained: bool = True
    published_revision: int = 0


class VersionRegistry:
    """Versions of models, per tenant, in etcd."""

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys | None = None,
        *,
        retain: int = DEFAULT_RETAIN,
        collector: Executor | None = None,
        usage_cache: usage.UsageCache | None = None,
    ) -> None:
        """`collector`, when given, runs retention after a publish in the background, so a
        publish returns as soon as its transaction commits (the hub passes one);
        `usage_cache`: the replica's cached usage keys, which retention keeps up to date."""
        if retain < 1:
            raise InvalidArgument(f"retain must be at least 1, got {retain}")
        self.etcd = etcd
        self.keys = keys or Keys()
        self.retain = retain
        self._collector = collector
        self._usage_cache = usage_cache
        self.manifests = ManifestStore(etcd, self.keys)
        self._publisher = Publisher(etcd, self.keys, self.manifests, self._after_publish)

    # -- reads -----------------------------------------------------------------------------

    def latest(self, tenant: str, model: str, *, timeout: float | None = None) -> tuple[int, int]:
        """(latest version or 0 if none, revision of the read). A linearizable read."""
        state = self._publisher.read_latest(tenant, model, timeout)
        return state.version, state.revision

    def latest_moved(
        self, tenant: str, model: str, *, timeout: float | None = None
    ) -> tuple[int, int]:
        """(latest version or 0 if none, the revision `latest` was moved at). A linearizable
        read: a reader that asks the holder index for that version waits for that revision."""
        state = self._publisher.read_latest(tenant, model, timeout)
        return state.version, state.mod_revision

    def versions(self, tenant: str, model: str, *, timeout: float | None = None) -> list[int]:
        """Published (complete) versions of a model, oldest first."""
        found, _ = self._scan(tenant, model, timeout)
        return sorted(v for v, complete in found.items() if complete)

    def _scan(self, tenant: str, model: str, timeout: float | None) -> tuple[dict[int, bool], int]:
        """Every version that has keys: version -> has a manifest (is published)."""
        keys, revision = self.etcd.range_keys(self.keys.versions(tenant, model), timeout=timeout)
        found: dict[int, bool] = {}
        parsed = self.keys.parse_version_keys(tenant, model, map(bytes.decode, keys))
        for version, kind, _ in parsed:  # a version's shard and holder records too: thousands
            found[version] = found.get(version, False) or kind == "manifest"
        return found, revision

    def models(self, tenant: str, *, timeout: float | None = None) -> list[str]:
        """Models of a tenant that have a `latest` key."""
        base = self.keys.models(tenant)
        result = self.etcd.range(base, prefix=True, keys_only=True, timeout=timeout)
        names = {kv.key.decode()[len(base) :].split("/", 1)[0] for kv in result.kvs}
        return sorted(n for n in names if n)

    def revision(self, tenant: str, *, timeout: float | None = None) -> int:
        """etcd's revision now, from one linearizable read of a key of `tenant`'s: what a
        listing that read nothing else answers at."""
        return self.etcd.get(self.keys.tenant(tenant), timeout=timeout)[1]

    def describe(
        self, tenant: str, model: str, version: int, *, timeout: float | None = None
    ) -> VersionInfo:
        """Everything about one version, read at one revision. `VersionNotFound` if unpublished."""
        validate_version(version)
        result = self.etcd.range(
            self.keys.version(tenant, model, version), prefix=True, timeout=timeout
        )
        top: ops.KV | None = None
        shards: list[ShardRecord] = []
        holders: list[HolderRecord] = []
        pins: list[str] = []
        for kv in result.kvs:
            _, kind, name = self.keys.parse_version_key(tenant, model, kv.key.decode())
            if kind == "manifest":
                top = kv
            elif kind == "shard":
                shards.append(ShardRecord.decode(kv.value))
            elif kind == "h":
                holders.append(HolderRecord.decode(kv.value, kv.create_revision))
            elif kind == "pin":
                pins.append(name)
        header = self.manifests.parse(model, version, [top] if top else [], shards)
        shards.sort(key=lambda s: s.index)
        parts: dict[int | None, PartHeader] = {s.index: s.part for s in shards}
        if header.whole is not None:
            parts = {None: header.whole}
        loaded = self.manifests.load(
            tenant, model, version, parts, result.revision, timeout=timeout
        )
        return VersionInfo(
            version, loaded.get(None, b""), [replace(s, manifest=loaded[s.index]) for s in shards],
            holders, pins, result.revision, published_revision=header.published_revision,
        )  # fmt: skip

    def header(
        self, tenant: str, model: str, version: int, *, timeout: float | None = None
    ) -> ManifestHeader:
        """A published version's manifest header (sizes, digests, shards), without pages."""
        validate_version(version)
        return self.manifests.header(tenant, model, version, timeout=timeout)

    def manifest(
        self,
        tenant: str,
        model: str,
        version: int,
        shard: int | None = None,
        *,
        timeout: float | None = None,
    ) -> bytes:
        """A published version's manifest (or shard `shard`'s), checked: `VersionNotFound`
        if it is gone, `IntegrityError` if its bytes do not match the header."""
        validate_version(version)
        return self.manifests.read(tenant, model, version, shard, timeout=timeout)

    # -- publish ---------------------------------------------------------------------------

    def publish(
        self,
        tenant: str,
        model: str,
        version: int,
        manifest: bytes,
        holder: HolderRecord,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        admit_model: Admit | None = None,
        charge: Charge | None = None,
        serial: AbstractContextManager[object] | None = None,
        session_key: str | None = None,
        views: Sequence[tuple[str, bytes]] = (),
        admit_views: Admit | None = None,
        declared: tuple[Callable[[float], list[ops.Cmp]], list[ops.Op]] | None = None,
    ) -> Published:
        """Publish `version` with its manifest and the publisher as first (COMPLETE) holder.

        Raises `StaleVersion` if `version` is not newer than `latest`, `ManifestTooLarge`
        (before any write) past `MAX_MANIFEST_BYTES`, and `OutcomeUnknown` if etcd could not
        confirm the write before the deadline (check `latest()` after). `admit_model` (a
        `CountedCreate`'s admit) is asked while the model has no `latest` yet; what it
        returns joins the transaction, so a model quota holds under races. `charge` (a
        `consistency.usage.TenantBudget`'s) is asked before every attempt and joins it too;
        `serial` (a lock) is held around each attempt, so that publishes sharing a charge
        key wait for each other here instead of failing each other's compares in etcd.
        `session_key` (the tenant's record of the holder's session) is compared in every
        write under that lease, pages included: a lease that is not the tenant's live
        session fails it with `SessionExpired`, with no read before. `views` (view model,
        manifest) are committed as version `version` of those models in the same
        transaction (`consistency.view_publish`), with `admit_views` (the model quota's
        admission of the model and its view models, in place of `admit_model`: one fence
        put per transaction) asked at every attempt. `declared` (`DeclaredLayouts.publish_ops`:
        the compare of the model's declared layouts, asked before each attempt, and the puts
        of their publisher checksums) joins the transaction too.
        """
        validate_version(version)
        check_manifest_size(len(manifest))
        if holder.shard is not None:
            raise InvalidArgument("a holder of a whole version cannot name a shard")
        holder = self._complete(holder)
        deadline = time.monotonic() + timeout
        if views:
            return self._publish_with_views(
                tenant, model, version, manifest, holder, timeout, deadline, admit_model,
                charge, serial, session_key, views, admit_views, declared,
            )  # fmt: skip
        staged = self.manifests.stage(
            tenant, model, version, None, manifest, holder.session, timeout=timeout,
            owner=session_key,
        )  # fmt: skip
        return self._publisher.publish_staged(
            tenant, model, version, holder, staged, self.keys.manifest(tenant, model, version),
            replace(staged.header, session=holder.session).encode(),
            [ops.put(self.keys.latest(tenant, model), str(version)),
             *(declared[1] if declared else [])], [],
            deadline, admit_model, None if declared is None else declared[0],
            charge=charge, serial=serial, session_key=session_key,
        )  # fmt: skip

    def _publish_with_views(
        self,
        tenant: str,
        model: str,
        version: int,
        manifest: bytes,
        holder: HolderRecord,
        timeout: float,
        deadline: float,
        admit_model: Admit | None,
        charge: Charge | None,
        serial: AbstractContextManager[object] | None,
        session_key: str | None,
        views: Sequence[tuple[str, bytes]],
        admit_views: Admit | None,
        declared: tuple[Callable[[float], list[ops.Cmp]], list[ops.Op]] | None,
    ) -> Published:
        """`publish` with views: each view's manifest staged, and its writes, compares,
        quota admission and charge joined to the version's transaction
        (`consistency.view_publish`); its retention run after."""
        for _, view_manifest in views:
            check_manifest_size(len(view_manifest))
        staged_views = StagedViews(self.keys, self.manifests, tenant, version)
        staged_views.stage(views, holder, timeout=timeout, owner=session_key)
        try:
            staged = self.manifests.stage(
                tenant, model, version, None, manifest, holder.session, timeout=timeout,
                owner=session_key,
            )  # fmt: skip
            published = self._publisher.publish_staged(
                tenant, model, version, holder, staged, self.keys.manifest(tenant, model, version),
                replace(staged.header, session=holder.session).encode(),
                [ops.put(self.keys.latest(tenant, model), str(version)),
                 *staged_views.writes(holder), *(declared[1] if declared else [])],
                [], deadline, None if admit_views is not None else admit_model,
                None if declared is None else declared[0],
                charge=ViewsCharge(charge, admit_views, staged_views),
                serial=serial, session_key=session_key,
            )  # fmt: skip
        except OutcomeUnknown:
            raise  # the pages may be live now; if not, they go with the lease
        except BaseException:
            staged_views.discard(DEFAULT_TIMEOUT / 2)
            raise
        return published  # its retention (`collect`) collects the views with the version

    def stage_shard(
        self,
        tenant: str,
        model: str,
        version: int,
        index: int,
        count: int,
        manifest: bytes,
        holder: HolderRecord,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        session_key: str = "",
        pack: bool = False,
        views: Sequence[tuple[str, bytes]] = (),
        extra: Sequence[tuple[str, bytes]] = (),
    ) -> ShardEntry:
        """Check one rank's shard publish and write its manifest's pages (if any) under its
        session: a `ShardEntry` ready for a batch (`shard_committer`). With `session_key`,
        the batch commits it only while that key exists (the hub: the session's mark as
        the caller tenant's own). With `pack` (a group publish), a manifest that fits
        (`consistency.manifest_packs`) is compressed instead, and its batch writes it: then
        nothing is written here. `views` (view model, manifest bytes): the rank's shard of
        each view of the version, staged likewise (never packed) and committed with it
        (`consistency.shard_commit`, `ViewShard`); what was staged is discarded if any fails.
        `extra`: (key, value) puts committed with the shard (its parts of the publisher's
        checksums of declared layouts, `consistency.declared_layouts`)."""
        validate_version(version)
        check_shard_count(count)
        if not 0 <= index < count:
            raise InvalidArgument(f"shard index {index} out of range for {count} shards")
        if holder.shard is not None and holder.shard != index:
            raise InvalidArgument(f"holder names shard {holder.shard} but publishes shard {index}")
        check_manifest_size(len(manifest), f"the manifest of shard {index}")
        holder = self._complete(holder, index)
        deadline = time.monotonic() + timeout
        if pack and manifest_packs.packable(len(manifest), SHARD_INLINE_BYTES):
            # its record names its batch's pack: the batch makes it (`ShardCommitter`)
            staged = Staged(PartHeader(len(manifest), hashlib.sha256(manifest).digest()), [], [])
            packed, record = manifest_packs.compress(manifest), b""
        else:
            staged = self.manifests.stage(
                tenant, model, version, index, manifest, holder.session, timeout=timeout
            )
            part = replace(staged.header, session=holder.session)
            packed, record = b"", ShardRecord(index, count, holder.holder, part).encode()
        made: list[ViewShard] = []
        try:
            for view_model, view_manifest in views:
                check_manifest_size(
                    len(view_manifest), f"the {view_model} manifest of shard {index}"
                )
                view_staged = self.manifests.stage(
                    tenant, view_model, version, index, view_manifest, holder.session,
                    timeout=max(deadline - time.monotonic(), 0.01),
                )  # fmt: skip
                view_part = replace(view_staged.header, session=holder.session)
                made.append(ViewShard(
                    view_model, view_staged,
                    ShardRecord(index, count, holder.holder, view_part).encode(),
                ))  # fmt: skip
        except BaseException:
            for done in made:
                key = self.keys.shard(tenant, done.model, version, index)
                self.manifests.discard(done.staged, key, done.record, DEFAULT_TIMEOUT / 2)
            if staged.prefix:
                key = self.keys.shard(tenant, model, version, index)
                self.manifests.discard(staged, key, record, DEFAULT_TIMEOUT / 2)
            raise
        size = len(manifest) + sum(len(m) + usage.RECORD_BYTES for _, m in views)
        return ShardEntry(
            index, count, holder, staged, record, size, deadline, session_key,
            packed=packed, views=made, extra=[ops.put(k, v) for k, v in extra],
            extra_bytes=sum(len(v) for _, v in extra),
        )  # fmt: skip

    def shard_committer(
        self,
        tenant: str,
        model: str,
        version: int,
        *,
        admit_model: Admit | None = None,
        budget: Budget | None = None,
    ) -> ShardCommitter:
        """The committer of `model@version`'s shards, with this registry's retention."""
        return ShardCommitter(
            self.etcd, self.keys, self.manifests, tenant, model, validate_version(version),
            admit_model=admit_model, budget=budget, on_visible=self._after_publish,
        )  # fmt: skip

    @staticmethod
    def _complete(holder: HolderRecord, shard: int | None = None) -> HolderRecord:
        """The publisher's record as written: COMPLETE and, with `shard`, of that shard
        (one copy of the record)."""
        if holder.session <= 0:
            raise InvalidArgument("a publisher's holder record needs its session (lease) id")
        if shard is None:
            return holder.with_state(HolderState.COMPLETE)
        return replace(holder, state=HolderState.COMPLETE, shard=shard)

    # -- retention -------------------------------------------------------------------------

    def retained(self, tenant: str, model: str, *, timeout: float | None = None) -> list[int]:
        """The newest N published versions (their last holder may not drop them silently)."""
        return self.versions(tenant, model, timeout=timeout)[-self.retain :]

    def collect(self, tenant: str, model: str, *, timeout: float | None = None) -> list[int]:
        """Delete versions older than the newest N published ones, except pinned ones, and
        the same versions of the model's views (`collect_view`), whether or not the publish
        that ran it carried views: a view goes with its version (docs/views.md)."""
        found, _ = self._scan(tenant, model, timeout)
        published = sorted(v for v, complete in found.items() if complete)
        if len(published) <= self.retain:
            return []
        oldest_kept = published[-self.retain]
        deleted = [
            version
            for version in sorted(v for v in found if v < oldest_kept)
            if self._delete_unpinned(tenant, model, version, timeout)
        ]
        for view in views_of(model):
            self._collect_below(tenant, view, oldest_kept, timeout)
        return deleted

    def _delete_unpinned(
        self, tenant: str, model: str, version: int, timeout: float | None
    ) -> bool:
        """Delete one version unless it is pinned, giving its bytes back to the tenant's
        usage (`consistency.usage`) in the same transaction; whether it was deleted."""
        pins = self.keys.pins(tenant, model, version)

        def attempt() -> bool:  # the charge is read again with the usage at every attempt
            guard, put = usage.release_version(
                self.etcd, self.keys, tenant, model, version, timeout or 5.0
            )
            result = self.etcd.txn(
                [ops.none_under(pins), *guard],
                [
                    ops.delete(self.keys.version(tenant, model, version), prefix=True),
                    ops.delete(self.keys.manifest_pages(tenant, model, version), prefix=True),
                    ops.delete(self.keys.version_layouts(tenant, model, version), prefix=True),
                    ops.delete(self.keys.layout_charge(tenant, model, version)),
                    *put,
                ],
                [ops.get(pins, prefix=True, count_only=True)],
                timeout=timeout,
            )
            if result.succeeded:
                if self._usage_cache is not None:
                    self._usage_cache.remember(put, result.revision)
                return True
            if int(result.responses[0].response_range.count):
                return False  # pinned: kept
            raise LostRace(f"the usage of tenant {tenant} changed")  # read the usage again

        # A usage key that keeps changing: kept for now, the next publish collects again.
        try:
            return USAGE_RACES.compare_and_set(attempt, None, lambda: LostRace("usage busy"))
        except LostRace:
            return False

    def collect_view(
        self, tenant: str, model: str, view: str, *, timeout: float | None = None
    ) -> list[int]:
        """Delete the versions of `view` (a view model of `model`) older than the oldest
        version of `model` that retention keeps, except pinned ones: a view goes with its
        version (docs/views.md)."""
        kept = self.retained(tenant, model, timeout=timeout)
        if len(kept) < self.retain:
            return []
        return self._collect_below(tenant, view, kept[0], timeout)

    def _collect_below(
        self, tenant: str, model: str, oldest_kept: int, timeout: float | None
    ) -> list[int]:
        """Delete the versions of `model` below `oldest_kept`, except pinned ones."""
        found, _ = self._scan(tenant, model, timeout)
        return [
            version
            for version in sorted(v for v in found if v < oldest_kept)
            if self._delete_unpinned(tenant, model, version, timeout)
        ]

    def _after_publish(self, tenant: str, model: str) -> None:
        """Retention after a publish made a version visible: on `collector` when given."""
        if self._collector is not None:
            self._collector.submit(self._collect_quietly, tenant, model)
        else:
            self._collect_quietly(tenant, model)

    def _collect_quietly(self, tenant: str, model: str) -> None:
        try:
            self.collect(tenant, model)
        except TensorHubError as exc:  # retention is best effort; the next publish retries it
            log.warning("retention for %s/%s failed: %s", tenant, validate_name(model), exc)
