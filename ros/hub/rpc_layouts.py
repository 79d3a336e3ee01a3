"""Layout holder handlers: readers in another layout register, find and release the holders
of their blocks (docs/design-notes.md, "Readers in another layout"; `consistency.layouts`)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Protocol

from consistency.declared_layouts import DeclaredLayouts
from consistency.layout_records import BlockSetKey
from consistency.layouts import LayoutRegistry
from consistency.records import HolderRecord
from consistency.sessions import SessionRecords
from ros.hub.call import CallContext
from ros.hub.candidates import group_keys
from ros.hub.convert import holder_from_pb, holder_to_pb
from ros.hub.rpc import Runs, unary
from ros.hub.tenants import Tenant
from ros.manifest_check import check_topology
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument
from tensorhub.names import validate_name, validate_version

MAX_LAYOUT_CANDIDATES = 8
"""How many holders of a block set one ResolveLayout answers, nearest the caller first."""


def _distance(me: Mapping[str, str], other: Mapping[str, str]) -> int:
    """0: same host, 1: same rack, 2: same dc, 3: elsewhere: the first of Resolve's topology
    groups (`ros.hub.candidates.group_keys`) the two share, as Resolve and the planner rank."""
    return next(
        tier for tier, (a, b) in enumerate(zip(group_keys(me), group_keys(other), strict=True))
        if a == b
    )  # fmt: skip


def _nearest(
    records: list[HolderRecord], topology: Mapping[str, str], exclude: str
) -> list[HolderRecord]:
    """The `MAX_LAYOUT_CANDIDATES` nearest holders, older (smaller fence) first in a tier."""
    others = [r for r in records if r.holder != exclude]
    others.sort(key=lambda r: (_distance(topology, r.topology), r.revision))
    return others[:MAX_LAYOUT_CANDIDATES]


class LayoutHub(Runs, Protocol):
    """What the layout handlers use of a replica besides running calls: their timeout, the
    session records (a registration names its session), the tenant's layout registry and
    its declared layouts."""

    sessions: SessionRecords

    def timeout(self, context: CallContext) -> float: ...

    def layouts(self, tenant: Tenant) -> LayoutRegistry: ...

    def declared_layouts(self, tenant: Tenant) -> DeclaredLayouts: ...


class LayoutRPCs:
    """Layout holder handlers, over `consistency.layouts.LayoutRegistry`."""

    def __init__(self, hub: LayoutHub) -> None:
        self.hub = hub

    def _at(self, context: CallContext, request: _Named) -> BlockSetKey:
        tenant = context.tenant()
        return BlockSetKey(
            tenant.name,
            validate_name(request.model, "model"),
            validate_version(request.version),
            validate_name(request.layout, "layout"),
            validate_name(request.block_set, "block set"),
        )

    def _registry(self, context: CallContext) -> LayoutRegistry:
        return self.hub.layouts(context.tenant())

    @unary
    def RegisterLayoutHolder(
        self, request: pb.RegisterLayoutHolderRequest, context: CallContext
    ) -> pb.RegisterLayoutHolderResponse:
        """A holder of a block set, under the caller's session: PARTIAL (a reader that
        serves its chunks as they arrive, with no checksums to record yet; its
        registration pins the version, and the answer carries what a ResolveLayout at the
        registration's revision would, from the holder's topology) or COMPLETE (which
        drops that pin), whose checksums are recorded if no reader recorded them first
        (the answer says which are). Registering again under the same name keeps the
        record's fence."""
        at = self._at(context, request)
        holder = holder_from_pb(request.holder)
        if not holder.complete and request.block_sums:
            raise InvalidArgument("a PARTIAL layout holder records no checksums")
        if holder.shard is not None:
            raise InvalidArgument("a layout holder holds a block set, not a shard")
        blocks = bytes(request.blocks)
        if blocks and hashlib.sha256(blocks).hexdigest()[:32] != at.block_set:
            raise InvalidArgument("the block set's id is not the digest of its description")
        session_key = self.hub.sessions.key(at.tenant, holder.session)
        timeout = self.hub.timeout(context)
        if not holder.complete:
            # What a ResolveLayout would answer, read in the registration's transaction:
            # the reader picks its predecessor among these without a second call.
            fence, found = self._registry(context).register_partial(
                at, holder, session_key=session_key, timeout=timeout
            )
            chosen = _nearest(found.holders, holder.topology, holder.holder)
            return pb.RegisterLayoutHolderResponse(
                fence=fence, revision=found.revision, block_sums=found.sums,
                holders=[holder_to_pb(h) for h in chosen], total_holders=len(found.holders),
                publisher_sums=found.publisher_sums,
            )  # fmt: skip
        fence, revision, sums = self._registry(context).register(
            at, holder, list(request.block_sums), timeout=timeout,
            session_key=session_key, blocks=blocks,
        )  # fmt: skip
        return pb.RegisterLayoutHolderResponse(fence=fence, revision=revision, block_sums=sums)

    @unary
    def ResolveLayout(
        self, request: pb.ResolveLayoutRequest, context: CallContext
    ) -> pb.ResolveLayoutResponse:
        """The nearest holders of a block set (a bounded range read: O(1) in the number of
        holders), the checksums its first reader recorded and, for a layout declared before
        the version's publish, the publisher's."""
        at = self._at(context, request)
        check_topology(request.topology, "topology of the caller")
        found = self._registry(context).resolve(at, timeout=self.hub.timeout(context))
        chosen = _nearest(found.holders, dict(request.topology), request.holder)
        return pb.ResolveLayoutResponse(
            holders=[holder_to_pb(h) for h in chosen],
            block_sums=found.sums,
            revision=found.revision,
            total_holders=len(found.holders),
            publisher_sums=found.publisher_sums,
        )

    @unary
    def ResolveLayoutCover(
        self, request: pb.ResolveLayoutCoverRequest, context: CallContext
    ) -> pb.ResolveLayoutCoverResponse:
        """The block sets of `layout` (bounded) with a few holders of each, nearest first:
        what a reader in another layout may read its blocks from."""
        tenant = context.tenant()
        model = validate_name(request.model, "model")
        version = validate_version(request.version)
        layout = validate_name(request.layout, "layout")
        check_topology(request.topology, "topology of the caller")
        found, revision = self._registry(context).cover(
            tenant.name, model, version, layout, timeout=self.hub.timeout(context)
        )
        topology = dict(request.topology)
        return pb.ResolveLayoutCoverResponse(
            block_sets=[
                pb.LayoutBlockSet(
                    block_set=s.block_set,
                    blocks=s.blocks,
                    block_sums=s.sums,
                    publisher_sums=s.publisher_sums,
                    holders=[  # COMPLETE only (`cover` lists its `c/` keys): one pass
                        holder_to_pb(h) for h in _nearest(s.holders, topology, request.holder)
                    ],
                )
                for s in found
            ],
            revision=revision,
        )

    @unary
    def ReleaseLayoutHolder(
        self, request: pb.ReleaseLayoutHolderRequest, context: CallContext
    ) -> pb.ReleaseLayoutHolderResponse:
        at = self._at(context, request)
        holder = validate_name(request.holder, "holder")
        revision = self._registry(context).release(
            at, holder, request.session_id, timeout=self.hub.timeout(context)
        )
        return pb.ReleaseLayoutHolderResponse(revision=revision)

    @unary
    def DeclareLayout(
        self, request: pb.DeclareLayoutRequest, context: CallContext
    ) -> pb.DeclareLayoutResponse:
        """Declare (or replace) a rollout layout of a model: its versions published from
        now on carry the publisher's checksums of its block sets."""
        tenant = context.tenant()
        revision = self.hub.declared_layouts(tenant).declare(
            tenant.name, validate_name(request.model, "model"),
            validate_name(request.layout, "layout"), list(request.block_sets),
            timeout=self.hub.timeout(context),
        )  # fmt: skip
        return pb.DeclareLayoutResponse(revision=revision)

    @unary
    def RetireLayout(
        self, request: pb.RetireLayoutRequest, context: CallContext
    ) -> pb.RetireLayoutResponse:
        """Retire a declared layout: later publishes compute no checksums for it."""
        tenant = context.tenant()
        revision = self.hub.declared_layouts(tenant).retire(
            tenant.name, validate_name(request.model, "model"),
            validate_name(request.layout, "layout"), timeout=self.hub.timeout(context),
        )  # fmt: skip
        return pb.RetireLayoutResponse(revision=revision, retired=bool(revision))

    @unary
    def DeclaredLayouts(
        self, request: pb.DeclaredLayoutsRequest, context: CallContext
    ) -> pb.DeclaredLayoutsResponse:
        """A model's declared layouts and their mod revision (what a publisher computes
        checksums for, and names in its Publish)."""
        tenant = context.tenant()
        found = self.hub.declared_layouts(tenant).read(
            tenant.name, validate_name(request.model, "model"), timeout=self.hub.timeout(context)
        )
        return pb.DeclaredLayoutsResponse(
            layouts=[
                pb.DeclaredLayout(layout=name, block_sets=sets)
                for name, sets in sorted(found.layouts.items())
            ],
            revision=found.revision,
        )


_Named = pb.RegisterLayoutHolderRequest | pb.ResolveLayoutRequest | pb.ReleaseLayoutHolderRequest
