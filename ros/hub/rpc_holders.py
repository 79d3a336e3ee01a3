"""Holder handlers: register, update (fenced), release and pins.

They depend on `HolderHub`, the part of the replica they use, not on the whole
`ros.hub.state.HubState`, which provides it.
"""

from __future__ import annotations

from typing import Protocol

from consistency.sessions import SessionRecords
from ros.hub.call import CallContext
from ros.hub.convert import holder_from_pb, holder_to_pb
from ros.hub.holder_index import HolderIndex
from ros.hub.manifest_cache import ManifestCache
from ros.hub.rpc import Registries, unary
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument
from tensorhub.names import validate_name, validate_version


class HolderHub(Registries, Protocol):
    """What the holder handlers use of a replica besides `Registries` (running calls, their
    timeout, the tenant's registries): the session records (a registration or pin names
    its session), the manifest cache (a version's header) and the holder index (a
    registration's candidates)."""

    sessions: SessionRecords
    manifest_cache: ManifestCache
    holder_index: HolderIndex


class HolderRPCs:
    """Holder handlers: register, update (fenced), release and pins."""

    def __init__(self, hub: HolderHub) -> None:
        self.hub = hub

    @unary
    def RegisterHolder(
        self, request: pb.RegisterHolderRequest, context: CallContext
    ) -> pb.RegisterHolderResponse:
        tenant = context.tenant()
        timeout = self.hub.timeout(context)
        holder = holder_from_pb(request.holder)
        model = validate_name(request.model, "model")
        version = validate_version(request.version)
        # The session is a compare in the registration's transaction, and the version's
        # header comes from the replica's cache (the reader's Resolve read it): one trip.
        header = self.hub.manifest_cache.header(
            (tenant.name, model, version),
            lambda: self.hub.versions(tenant).header(tenant.name, model, version, timeout=timeout),
        )
        fence = self.hub.holders(tenant).register(
            tenant.name, model, version, holder, timeout=timeout,
            session_key=self.hub.sessions.key(tenant.name, holder.session),
            header=(header.published_revision, header.shard_count),
        )  # fmt: skip
        response = pb.RegisterHolderResponse(fence=fence, revision=fence)
        if not holder.complete:
            # What a Resolve with the new fence would answer: the reader plans its pipeline
            # over these (its predecessor among them) without a second Resolve.
            found = self.hub.holder_index.candidates(
                tenant.name, model, version, holder.shard,
                min_revision=fence, timeout=timeout, topology=holder.topology,
                fence=fence, exclude=holder.holder,
            )  # fmt: skip
            response.candidates.extend(holder_to_pb(h) for h in found.candidates)
            response.total_holders = found.total
            response.revision = max(fence, found.revision)
        return response

    @unary
    def UpdateHolder(
        self, request: pb.UpdateHolderRequest, context: CallContext
    ) -> pb.UpdateHolderResponse:
        tenant = context.tenant()
        timeout = self.hub.timeout(context)
        holder = holder_from_pb(request.holder)
        self.hub.holders(tenant).update_state(
            tenant.name, validate_name(request.model, "model"), validate_version(request.version),
            holder, request.holder.fence, timeout=timeout,
        )  # fmt: skip
        return pb.UpdateHolderResponse()

    @unary
    def ReleaseHolder(
        self, request: pb.ReleaseHolderRequest, context: CallContext
    ) -> pb.ReleaseHolderResponse:
        """Delete the caller's holder record: the session that registered it must be named
        (`session_id`), and is compared with the record's lease inside etcd."""
        tenant = context.tenant()
        revision = self.hub.holders(tenant).release(
            tenant.name, validate_name(request.model, "model"), validate_version(request.version),
            request.holder, force=request.force, session=_owner(request.session_id, "release"),
            timeout=self.hub.timeout(context),
        )  # fmt: skip
        return pb.ReleaseHolderResponse(revision=revision)

    @unary
    def Pin(self, request: pb.PinRequest, context: CallContext) -> pb.PinResponse:
        tenant = context.tenant()
        timeout = self.hub.timeout(context)
        self.hub.sessions.own(tenant.name, request.session_id, timeout)
        # Pins keep versions past retention: at most the retained-versions quota of them.
        revision = self.hub.holders(tenant).pin(
            tenant.name, validate_name(request.model, "model"), validate_version(request.version),
            request.pin_id, request.session_id,
            max_pinned=tenant.quotas.max_retained_versions, timeout=timeout,
        )  # fmt: skip
        return pb.PinResponse(revision=revision)

    @unary
    def Unpin(self, request: pb.UnpinRequest, context: CallContext) -> pb.UnpinResponse:
        """Drop the caller's pin: the session that pinned it must be named (`session_id`)."""
        tenant = context.tenant()
        revision = self.hub.holders(tenant).unpin(
            tenant.name, validate_name(request.model, "model"), validate_version(request.version),
            request.pin_id, session=_owner(request.session_id, "unpin"),
            timeout=self.hub.timeout(context),
        )  # fmt: skip
        return pb.UnpinResponse(revision=revision)


def _owner(session_id: int, what: str) -> int:
    """The session a release or unpin names as the owner of its record; one must be named."""
    if session_id <= 0:
        raise InvalidArgument(f"{what} must name the session that owns the record (session_id)")
    return session_id
