"""Publish handlers: `Publish` (a whole version, or one shard of a model-parallel
version) and `PublishShards` (the shards of one version a process group gathered, in one
call).

They depend on `PublishHub`, the part of the replica they use, not on the whole
`ros.hub.state.HubState`, which provides it; every etcd request they make goes through a
registry of `consistency` or through `Budgets` (`ros.hub.budget`). They are apart from the
version reads (`ros.hub.rpc_versions`): a publish checks and writes, a read answers from
the replica's caches and index. What they check of the request alone is
`ros.hub.publish_checks`; a group call's manifests checked in the checking processes,
`ros.hub.deferred_checks`; the batches its shards commit in, `ros.hub.shard_publish`.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from consistency import HolderRecord, HolderState
from consistency.declared_layouts import DeclaredLayouts
from consistency.manifests import ManifestHeader, written_before_batch
from consistency.publishing import Admit, Published
from consistency.sessions import SessionRecords
from ros.hub import manifest_reads
from ros.hub.budget import Budgets, model_serial
from ros.hub.call import CallContext
from ros.hub.companions import check_companion
from ros.hub.convert import holder_from_pb
from ros.hub.deferred_checks import Deferred, Staging, check_group_manifest, stage_all, verified
from ros.hub.manifest_cache import ManifestCache
from ros.hub.manifest_processes import ManifestCheck, ManifestProcesses
from ros.hub.publish_checks import (
    CallChecks,
    check_publish_limits,
    layout_parts,
    layout_sums,
    manifest_name,
)
from ros.hub.rpc import Registries, unary_async
from ros.hub.shard_group import publish_shards
from ros.hub.shard_publish import ShardBatches, ShardJob
from ros.hub.tenants import Tenant
from ros.hub.views import (
    check_pages,
    check_shard_pages,
    checked_views,
    refuse_view_name,
    views_charge,
)
from ros.manifest_check import check_manifest
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.raw_manifest import full_request
from tensorhub.delta_rules import is_companion
from tensorhub.errors import InvalidArgument
from tensorhub.names import validate_name, validate_version


class PublishHub(Registries, Protocol):
    """What the publish handlers use of a replica besides `Registries` (running calls, their
    timeout, the tenant's registries): the quota checks of a publish, sessions (a publish
    names one), the batches that commit shards, the manifest cache (seeded by a whole
    publish; a companion's base header), the checking processes of a group call's
    manifests, and the tenant's declared layouts (a whole publish's compare and publisher
    checksums)."""

    budgets: Budgets
    sessions: SessionRecords
    shard_batches: ShardBatches
    manifest_cache: ManifestCache
    manifest_processes: ManifestProcesses

    def declared_layouts(self, tenant: Tenant) -> DeclaredLayouts: ...


class PublishRPCs:
    """Publish handlers: a whole version or one shard (`Publish`), a group's shards in one
    call (`PublishShards`)."""

    def __init__(self, hub: PublishHub) -> None:
        self.hub = hub

    @unary_async
    async def Publish(self, request: pb.PublishRequest, call: CallContext) -> pb.PublishResponse:
        """Publish a whole version (in a worker, as any unary call), or one shard of a
        model-parallel version: checked and staged in a worker, then committed with the
        other shards of its version waiting on this replica (`ros.hub.shard_publish`)."""
        if not request.shard_count:
            published = await self.hub.blocking(
                self._publish_whole, request, call, deadline_of=call
            )
        else:
            published = await self._publish_shard(request, call)
        return pb.PublishResponse(
            version=published.version, revision=published.revision, visible=published.visible
        )

    @unary_async
    async def PublishShards(
        self, requests: AsyncIterator[Any], call: CallContext
    ) -> pb.PublishShardsResponse:
        """The shards of one version a process group gathered, in one call: each committed
        as its own `Publish` would be (`ros.hub.shard_group`): checked on the loop, staged a
        chunk at a time in a worker. Each request is a `RawPublishRequest`, its manifest
        the bytes it came as (`ros.raw_manifest`; the server reads this call's messages so).
        What every shard of the call shares (its model and version checked, their
        registry and admission, each session's key) is worked out once (`CallChecks`).
        Where the replica has checking processes, each chunk's manifests are checked in
        one of them before the chunk is staged (`ros.hub.deferred_checks`,
        `ros.hub.manifest_processes`)."""
        shared = CallChecks(deferred=self.hub.manifest_processes.active)
        return await publish_shards(
            requests,
            lambda request: self._checked_group_shard(request, call, shared),
            lambda stagings: self.hub.blocking(stage_all, stagings, deadline_of=call),
            self.hub.shard_batches.publish_all,
            lambda stagings: verified(self.hub.manifest_processes, stagings),
        )

    async def _publish_shard(self, request: pb.PublishRequest, call: CallContext) -> Published:
        """One shard: checked and staged, then committed in its version's next batch."""
        model, version, job = await self._staged_shard(request, call)
        return await self.hub.shard_batches.publish(model, version, job)

    async def _staged_shard(
        self, request: pb.PublishRequest, call: CallContext
    ) -> tuple[str, int, ShardJob]:
        """One shard checked and staged. Its manifest is serialized once, here: its size,
        its check (`check_manifest(serialized=)`), its digest and what is stored all come
        from those bytes."""
        manifest = request.manifest.SerializeToString()
        if (
            not written_before_batch(len(manifest), False)
            and not is_companion(request.model)
            and not request.views  # its view shards' manifests are staged first
        ):
            # Nothing to read or write before the batch: checked here, on the loop,
            # without a trip through the worker pool (a burst is thousands of these).
            # A companion's shard may read its base's header: in a worker.
            return self._stage_shard(request, call, False, manifest)
        return await self.hub.blocking(
            self._stage_shard, request, call, False, manifest, deadline_of=call
        )

    def _checked_group_shard(
        self, raw: Any, call: CallContext, shared: CallChecks
    ) -> asyncio.Future[Staging]:
        """A group call's shard (a `RawPublishRequest`: its manifest as the bytes it came,
        `ros.raw_manifest`) checked (as `_staged_shard`), with its staging left for its
        chunk's worker (`stage_all`): its manifest ready for its batch's pack
        (`consistency.manifest_packs`). Checked here, on the loop, into a future already
        done (no task a shard: a call is thousands of them); a shard whose manifest is
        paged (written before its batch), or a companion's, is parsed whole and staged in
        a worker, in a task."""
        manifest: bytes = raw.manifest
        if (
            not written_before_batch(len(manifest), True)
            and not is_companion(raw.model)
            and not raw.views  # its view shards' manifests are staged whole, in a worker
        ):
            checked: asyncio.Future[Staging] = asyncio.get_running_loop().create_future()
            try:
                checked.set_result(self._check_shard(raw, call, True, manifest, shared))
            except Exception as exc:  # its refusal, the shard's outcome
                checked.set_exception(exc)
            return checked
        return asyncio.ensure_future(self._staged_whole(raw, call, manifest))

    async def _staged_whole(self, raw: Any, call: CallContext, manifest: bytes) -> Staging:
        """A group call's shard parsed whole, then checked and staged in a worker."""
        request = full_request(raw)
        staged = await self.hub.blocking(
            self._stage_shard, request, call, True, manifest, deadline_of=call
        )
        return lambda: staged

    def _publish_checks(
        self,
        request: pb.PublishRequest,
        call: CallContext,
        *,
        session: bool,
        manifest: bytes | None = None,
        shared: CallChecks | None = None,
    ) -> tuple[Tenant, float, str, int, bytes, HolderRecord, Admit]:
        """What every publish checks first: the caller, the bounds, its session (with
        `session`; else the batch's own transaction does); and the model quota's admission.
        The callers check the budget next (one etcd read: a refusal costs little) and then
        every manifest rule (a walk over every tensor), all before any write. `manifest`:
        the request's manifest as serialized by the caller (a shard's), else serialized here.
        `shared`: what the shards of one group call share, checked by its first shard (a
        shard with views or of a companion is not checked with it: its checks read them)."""
        tenant = call.tenant()
        timeout = self.hub.timeout(call)
        if request.shards:  # a message of a PublishShards stream carries them, none else
            raise InvalidArgument(
                "a publish carries no `shards` of its own (a PublishShards message carries "
                "either its own shard or its shards)"
            )
        if request.shard_count and request.layout_sums:
            raise InvalidArgument("a shard carries its parts of the publisher's checksums")
        if not request.shard_count and request.layout_parts:
            raise InvalidArgument("a whole publish carries the publisher's checksums whole")
        known = shared.version.get((request.model, request.version)) if shared else None
        if known is not None:  # a shard of the version its call's first shard checked
            check_publish_limits(request, None if manifest is None else len(manifest))
            holder = holder_from_pb(request.holder, default_state=HolderState.COMPLETE)
            if session:
                self.hub.sessions.own(tenant.name, holder.session, timeout)
            if manifest is None:
                manifest = request.manifest.SerializeToString()
            model, version, admit = known
            return tenant, timeout, model, version, manifest, holder, admit
        model = validate_name(request.model, "model")
        version = validate_version(request.version)
        # bounds first: a limit answers before any work
        check_publish_limits(request, None if manifest is None else len(manifest))
        check_companion(  # a reserved name: only a delta publish's own companion
            request,
            lambda base_model, base: manifest_reads.header(
                self.hub, tenant, base_model, base, timeout
            ),
        )
        refuse_view_name(request)  # a reserved name: views come only with their version
        if manifest is None:
            manifest = request.manifest.SerializeToString()
        holder = holder_from_pb(request.holder, default_state=HolderState.COMPLETE)
        if session:
            self.hub.sessions.own(tenant.name, holder.session, timeout)
        admit = self.hub.budgets.admission(tenant, self.hub.versions(tenant), model)
        if shared is not None:
            shared.version[(request.model, request.version)] = (model, version, admit)
        return tenant, timeout, model, version, manifest, holder, admit

    def _publish_whole(self, request: pb.PublishRequest, call: CallContext) -> Published:
        # The session is compared in the publish's own writes (`session_key`), not read
        # before them; the budget is checked against the replica's cached usage.
        tenant, timeout, model, version, manifest, holder, admit = self._publish_checks(
            request, call, session=False
        )
        views = checked_views(request) if request.views else []  # docs/views.md
        if views:
            check_pages(len(manifest), views)
        # the etcd budget: refused here, before any write
        charge = self.hub.budgets.whole(tenant, len(manifest) + views_charge(views), timeout)
        check_manifest(  # every rule, before any write
            request.manifest, manifest_name(request), model=request.model, version=request.version
        )
        declared = (
            self.hub.declared_layouts(tenant).publish_ops(
                tenant.name, model, version, request.declared_revision, layout_sums(request)
            )
            if request.HasField("declared_revision")
            else None
        )
        published = self.hub.versions(tenant).publish(
            tenant.name, model, version, manifest, holder, timeout=timeout, declared=declared,
            admit_model=admit, charge=charge, serial=model_serial(tenant.name, model),
            session_key=self.hub.sessions.key(tenant.name, holder.session), views=views,
            admit_views=(
                self.hub.budgets.admission_of(
                    tenant, self.hub.versions(tenant), [model, *(name for name, _ in views)]
                ) if views else None
            ),
        )  # fmt: skip
        # what its readers' Resolves ask next: the header and manifest as stored (`stage`)
        parsed = pb.Manifest()
        parsed.CopyFrom(request.manifest)
        header = ManifestHeader(
            published.revision, len(manifest), hashlib.sha256(manifest).digest(),
            session=holder.session,
        )  # fmt: skip
        self.hub.manifest_cache.seed((tenant.name, model, version), header, parsed, len(manifest))
        return published

    def _stage_shard(
        self, request: pb.PublishRequest, call: CallContext, group: bool, serialized: bytes
    ) -> tuple[str, int, ShardJob]:
        """A shard publish checked and its manifest (`serialized`) staged: a job for its
        version's next batch (`_check_shard`, then its staging)."""
        return self._check_shard(request, call, group, serialized)()

    def _check_shard(
        self,
        request: pb.PublishRequest,
        call: CallContext,
        group: bool,
        serialized: bytes,
        shared: CallChecks | None = None,
    ) -> Staging:
        """A shard publish checked, every rule before any write; its staging (of its
        manifest, `serialized`) to run next: a job for its version's next batch. Its session
        and budget are checked in the batch's own transaction, race-free and once per
        batch; only a shard whose manifest is paged (a write before the batch) checks them
        first, so that a refused publish writes nothing."""
        views = checked_views(request) if request.views else []  # docs/views.md
        paged = written_before_batch(len(serialized), group) or bool(views)
        tenant, timeout, model, version, manifest, holder, admit = self._publish_checks(
            request, call, session=paged, manifest=serialized, shared=shared
        )
        if views:
            check_shard_pages(len(manifest), views)
        if paged:  # the tokens its arrival takes, as far as the version's counter says now
            self.hub.budgets.shard(
                tenant, model, version, len(manifest) + views_charge(views),
                request.shard_count, timeout,
            )  # fmt: skip
        deferred = False
        check: ManifestCheck = (manifest, manifest_name(request), request.model, request.version)
        if isinstance(request.manifest, bytes):  # a group call's (`_checked_group_shard`)
            # its manifest's rules are the last checked (no parts, views or pages follow):
            # with checking processes, decided in one of them before it is staged
            deferred = (
                shared is not None and shared.deferred and not paged
                and not request.HasField("declared_revision")
            )  # fmt: skip
            if not deferred:
                check_group_manifest(check)  # every rule, before any write
        else:
            check_manifest(  # every rule, before any write
                request.manifest, manifest_name(request), model=request.model,
                version=request.version, serialized=manifest,
            )  # fmt: skip
        versions = shared.versions(self.hub, tenant) if shared else self.hub.versions(tenant)
        if views:  # the model quota's admission of the model and its view models
            admit = self.hub.budgets.admission_of(
                tenant, versions, [model, *(name for name, _ in views)]
            )
        index, count = request.shard_index, request.shard_count
        parts = (
            [(versions.keys.publisher_part(tenant.name, model, version, index),
              layout_parts(request))]
            if request.HasField("declared_revision")
            else []
        )  # fmt: skip
        session_key = (
            shared.session_key(self.hub.sessions, tenant.name, holder.session)
            if shared
            else self.hub.sessions.key(tenant.name, holder.session)
        )
        deadline = time.monotonic() + timeout

        def staging() -> tuple[str, int, ShardJob]:
            entry = versions.stage_shard(
                tenant.name, model, version, index, count, manifest, holder,
                timeout=max(deadline - time.monotonic(), 0.0), session_key=session_key,
                pack=group, views=views, extra=parts,
            )  # fmt: skip
            return model, version, ShardJob(tenant, versions, admit, entry)

        return Deferred(check, staging) if deferred else staging
