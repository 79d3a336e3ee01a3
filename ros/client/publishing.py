"""The publish side of the SDK: a version served from the publisher's own memory.

`Publish` is not idempotent (a resent publish whose first attempt landed looks stale), so it
is never retried blindly: each attempt is one gRPC try (`HubRpc.once`), and `PUBLISH_RESEND`
allows one more attempt only after a read-back found that the first did not land.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence

import torch

from consistency.floor import RevisionFloor
from consistency.retry import RetryPolicy
from ros.client.delta_publish import WHERE, BaseCopies
from ros.client.dtensors import for_publish
from ros.client.group_publish import ProcessGroup, Send, publish_in_group
from ros.client.handles import Handles, Publication
from ros.client.holdings import Holdings
from ros.client.identity import Identity
from ros.client.manifest import Placements, manifest_of
from ros.client.publisher_sums import DeclaredCache, layout_parts, layout_sums
from ros.client.reads import FreshReads
from ros.client.records import HolderRecords
from ros.client.rpc import Rpc
from ros.client.serving import Serving
from ros.client.view_publish import (
    MadeView,
    check_publish_views,
    is_model_parallel,
    make_shard_view_versions,
    make_views,
)
from ros.manifest_check import check_manifest
from ros.metrics import SDK_PUBLISH_SECONDS
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.views.shard_view import abstain, make_shard_views
from tensorhub.declared_records import MAX_PARTS_SHARDS
from tensorhub.errors import (
    DeadlineExceeded,
    InvalidArgument,
    LayoutsChanged,
    OutcomeUnknown,
    StaleVersion,
    TensorHubError,
    Unavailable,
    VersionNotFound,
)
from tensorhub.names import validate_name, validate_version
from transport.layout import Layout
from transport.store import HeldVersion

log = logging.getLogger(__name__)


class _Resend(Exception):
    """The first attempt broke on the connection and a read-back found it did not land:
    nothing of it was written, so the next attempt is a fresh publish. A signal to
    `PUBLISH_RESEND` only: it is never raised out of its loop."""


DECLARED_TRIES = 3
"""Sends of one whole publish, each after reading the model's declared layouts again (a
declaration or retirement between the read and the publish: `LayoutsChanged`)."""

DECLARED_TTL = 10.0
"""Seconds a shard's publisher uses the declared layouts it read before reading them again
(one `DeclaredLayouts` call a rank per this time): a layout declared this long before a
sharded publish has its checksums recorded with it."""

PUBLISH_RESEND = RetryPolicy(tries=2, retry_on=lambda e: isinstance(e, _Resend))
"""A publish is sent at most twice, the second only after `_Resend`."""


class Publisher:
    """`Hub.publish` for one client, and its retry-safe recovery when the hub's reply is
    lost."""

    def __init__(
        self,
        me: Identity,
        rpc: Rpc,
        reads: FreshReads,
        records: HolderRecords,
        holdings: Holdings,
        serving: Serving,
        handles: Handles,
        policy: RetryPolicy = PUBLISH_RESEND,
    ) -> None:
        self._me = me
        self._rpc = rpc  # tried once per call: `policy` decides about a second attempt
        self._reads = reads  # Inspect, to read back a publish whose reply was lost
        self._floor: RevisionFloor = reads.floor
        self._records = records
        self._holdings = holdings
        self._serving = serving
        self._handles = handles
        self._policy = policy
        self._bases = BaseCopies(me.tenant)  # delta=True: what each model's next encodes against
        self._declared = DeclaredCache()  # per model: its declared layouts, as last read
        # Versions whose publish ended OutcomeUnknown: still served (it may have landed)
        # until this client publishes them again, which replaces what it holds.
        self._in_doubt: set[tuple[str, str, int]] = set()
        self._lock = threading.Lock()

    def publish(
        self,
        model: str,
        version: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        chunk_size: int | None = None,
        timeout: float | None = None,
        shard: tuple[int, int] | None = None,
        placements: Placements | None = None,
        checksum: str | None = None,
        metadata: Mapping[str, str] | None = None,
        delta: bool = False,
        base_copy: str = "host",
        group: ProcessGroup | None = None,
        send: Send | None = None,
        views: Sequence[str] = (),
        view_group: ProcessGroup | None = None,
    ) -> Publication:
        """`Hub.publish` (its docstring says what a caller gets). `send`: this rank's
        Publish through its group's one call (`ros.client.group_publish`). `views`: the
        view formats published with it (`ros.client.view_publish`); for one rank's shard,
        made with the other ranks over `view_group` (`group`'s; the default group when
        neither is given)."""
        formats = check_publish_views(model, views)
        if group is not None:
            return publish_in_group(group, self._rpc, lambda send: self.publish(
                model, version, tensors, chunk_size=chunk_size, timeout=timeout, shard=shard,
                placements=placements, checksum=checksum, metadata=metadata, delta=delta,
                base_copy=base_copy, send=send, views=formats, view_group=group,
            ))  # fmt: skip
        sharded = bool(formats) and is_model_parallel(tensors, shard, placements, view_group)
        joined = False  # whether this rank took part in its views' agreement (`abstain`)
        try:
            derived = for_publish(tensors, shard, placements)  # a state dict of DTensors
            if derived is not None and derived.shard is None:
                # this rank publishes no block (a replica): no shard, but its views'
                # agreement waits for every rank of the group
                if sharded:
                    joined = True
                    make_shard_views({}, {}, formats, view_group)
                empty = self._handles.publication(model, version, {}, 0, False, None)
                empty.released = True  # it holds nothing to release
                return empty
            if derived is not None:
                tensors, shard, placements = derived.tensors, derived.shard, derived.placements
            if placements and shard is None:
                raise InvalidArgument("placements describe a model-parallel shard: pass shard too")
            if shard is not None and not (isinstance(shard, tuple) and len(shard) == 2):
                raise InvalidArgument(f"shard must be (index, count), got {shard!r}")
            validate_name(model, "model")
            validate_version(version)
            if base_copy not in WHERE:
                raise InvalidArgument(f"base_copy {base_copy!r}: one of {', '.join(WHERE)}")
            start = time.monotonic()
            own = _contiguous(tensors)
            layout = (
                Layout.from_tensors(own)
                if chunk_size is None
                else Layout.from_tensors(own, chunk_size)
            )
            held = HeldVersion.publisher(self._me.tenant, model, version, own, layout)
            manifest = manifest_of(held, placements, checksum)
        except BaseException as exc:
            if sharded and not joined:  # the other ranks raise instead of waiting for it
                abstain(view_group, exc)
            raise
        if metadata:
            manifest.metadata.update(metadata)
        if sharded:
            made = make_shard_view_versions(
                self._me.tenant, model, version, own, placements, formats, view_group,
                held.layout.chunk_size, checksum, metadata,
            )  # fmt: skip
        else:
            made = make_views(self._me.tenant, model, version, own, formats,
                              held.layout.chunk_size, checksum, metadata)  # fmt: skip
        index = None if shard is None else shard[0]
        companion = None
        companions: list[Publication | None] = []  # the views' own, in `made`'s order
        try:
            if delta:
                companion = self._publish_delta(held, manifest, shard, timeout)
                companions = [self._publish_delta(view.held, view.manifest, shard, timeout)
                              for view in made]  # fmt: skip
            publication = self._publish(held, manifest, shard, timeout, start, send, made)
        except BaseException:
            for published in (companion, *companions):
                if published is not None:
                    published.release(force=True)
            if delta:  # its encode brought the base copy to this version: not published
                self._bases.forget(model, index)
                for view in made:
                    self._bases.forget(view.held.key[1], index)
            raise
        publication.companion = companion
        for view, encoded in zip(made, companions, strict=False):
            publication.views[view.fmt].companion = encoded
        if delta:
            self._bases.keep(model, index, held, manifest, base_copy)
            for view in made:  # a view's delta is on its fp8 bytes and scales
                self._bases.keep(view.held.key[1], index, view.held, view.manifest, base_copy)
        return publication

    def base_bytes(self) -> int:
        """Bytes of the base copies kept by `delta=True` now."""
        return self._bases.nbytes()

    def drop_bases(self, model: str | None) -> None:
        """Free the base copies kept by `delta=True` (of `model`; None: all)."""
        self._bases.drop(model)

    def _publish_delta(
        self,
        held: HeldVersion,
        manifest: pb.Manifest,
        shard: tuple[int, int] | None,
        timeout: float | None,
    ) -> Publication | None:
        """Encode `held` against this client's copy of the version it published before and
        publish the encoded chunks as the companion's version (module `delta_publish`); add
        the delta section to `manifest`. None, with v to be published whole, when there is
        no copy to encode against or nothing is worth encoding; a companion publish that
        fails is logged and v is published whole (readers lose bytes saved, never data)."""
        _, model, version = held.key
        index = None if shard is None else shard[0]
        try:
            encoded = self._bases.encode(model, index, held, manifest)
        except (TensorHubError, RuntimeError) as exc:  # torch's errors are RuntimeErrors
            log.warning("%s@%d was not encoded as a delta (%s): publishing it whole",
                        model, version, exc)  # fmt: skip
            return None
        if encoded is None:
            return None
        try:
            companion = self.publish(
                encoded.section.companion, version, encoded.tensors,
                chunk_size=held.layout.chunk_size, timeout=timeout, shard=shard,
                metadata={"tensorhub.delta-of": model, "tensorhub.delta-base": str(
                    encoded.section.base)},
            )  # fmt: skip
        except TensorHubError as exc:
            log.warning(
                "the delta of %s@%d against %d was not published (%s): publishing it whole",
                model, version, encoded.section.base, exc,
            )  # fmt: skip
            return None
        manifest.delta.CopyFrom(encoded.section)
        return companion

    def _publish(
        self,
        held: HeldVersion,
        manifest: pb.Manifest,
        shard: tuple[int, int] | None,
        timeout: float | None,
        start: float,
        send: Send | None = None,
        views: Sequence[MadeView] = (),
    ) -> Publication:
        """Publish `held` with `manifest`: the hub's checks here first, then the holding,
        the Publish call (or `send`) and its handle. `views`: held and published with it,
        in the same Publish (each its own version, `ros.client.view_publish`)."""
        _, model, version = held.key
        # the hub's own rules, so a manifest it would refuse fails here with its message
        what = "manifest" if shard is None else f"manifest of shard {shard[0]}"
        check_manifest(manifest, what, model=model, version=version)
        for view in views:
            check_manifest(view.manifest, f"manifest of the {view.fmt} view",
                           model=view.held.key[1], version=version)  # fmt: skip
        self._serving.start()
        index = None if shard is None else shard[0]
        keys = [held.key, *(view.held.key for view in views)]
        with self._lock:
            doubted = [key for key in keys if key in self._in_doubt]
            self._in_doubt.difference_update(keys)
        for key in doubted:  # the retry OutcomeUnknown asks for: it replaces the holding
            self._holdings.drop(key, 0.0)
        self._holdings.hold(held, index)
        for view in views:
            self._holdings.hold(view.held, index)
        request = pb.PublishRequest(
            model=model,
            version=version,
            manifest=manifest,
            holder=self._records.record(complete=True, shard=index),
        )
        if shard is not None:
            request.shard_index, request.shard_count = shard
        for view in views:
            request.views.append(pb.PublishView(format=view.fmt, manifest=view.manifest))
        try:
            if shard is not None:  # a shard, alone or through its group: with its parts
                self._add_parts(request, held, manifest, shard[1], timeout)
            if send is not None:  # its group's one call (`ros.client.group_publish`)
                response = send(request, timeout)
            elif shard is None:  # a whole publish: with its declared layouts' checksums
                response = self._publish_declared(request, held, timeout)
            else:
                response = self._publish_rpc(request, timeout)
        except OutcomeUnknown:
            # It may have landed: its holder record would then name this client, so keep
            # serving the tensors (until it publishes again, or closes); a landed shard of a
            # visible version stays readable.
            with self._lock:
                self._in_doubt.update(keys)
            raise
        except BaseException:
            for key in keys:
                self._holdings.drop(key, 0.0)  # its shard too
            raise
        self._floor.observe(response.revision)
        SDK_PUBLISH_SECONDS.observe(time.monotonic() - start)
        revision, visible = int(response.revision), bool(response.visible)
        publication = self._handles.publication(
            model, version, held.tensors, revision, visible, index
        )
        for view in views:
            publication.views[view.fmt] = self._handles.publication(
                view.held.key[1], version, view.held.tensors, revision, visible, index
            )
        return publication

    def _publish_declared(
        self, request: pb.PublishRequest, held: HeldVersion, timeout: float | None
    ) -> pb.PublishResponse:
        """A whole publish with the publisher's checksums of its model's declared layouts
        (`ros.client.publisher_sums`), for the declarations this client last read; if the
        hub has others (`LayoutsChanged`: nothing was written), they are read again and the
        publish sent again, at most `DECLARED_TRIES` times in all."""
        model = request.model
        for attempt in range(DECLARED_TRIES):
            revision, declared = self._declared.get(model)
            request.declared_revision = revision
            del request.layout_sums[:]
            if declared:
                request.layout_sums.extend(
                    layout_sums(declared, held.tensors, held.layout.chunk_size)
                )
            try:
                return self._publish_rpc(request, timeout)
            except LayoutsChanged:
                if attempt == DECLARED_TRIES - 1:
                    raise
                read = pb.DeclaredLayoutsRequest(model=model)
                self._declared.put(model, self._rpc("DeclaredLayouts", read, timeout))
        raise AssertionError("unreachable")  # the loop returns or raises

    def _add_parts(
        self,
        request: pb.PublishRequest,
        held: HeldVersion,
        manifest: pb.Manifest,
        count: int,
        timeout: float | None,
    ) -> None:
        """Add this shard's parts of the checksums of its model's declared layouts
        (`ros.client.publisher_sums.layout_parts`), for the declarations as read at most
        `DECLARED_TTL` ago (read again past it). None for a version of more than
        `MAX_PARTS_SHARDS` shards, a model with none declared, or declarations that could
        not be read (logged): the version then records no sums, as when a shard sends none."""
        model = request.model
        if count > MAX_PARTS_SHARDS:
            return
        if self._declared.age(model) > DECLARED_TTL:
            read = pb.DeclaredLayoutsRequest(model=model)
            try:
                self._declared.put(model, self._rpc("DeclaredLayouts", read, timeout))
            except TensorHubError as exc:
                log.warning(
                    "%s: declared layouts not read (%s): no publisher checksums", model, exc
                )
                return
        revision, declared = self._declared.get(model)
        if not revision:
            return
        parts = layout_parts(declared, held.tensors, manifest, held.layout.chunk_size)
        if parts is None:
            return
        request.declared_revision = revision
        request.layout_parts.extend(parts)

    def _publish_rpc(self, request: pb.PublishRequest, timeout: float | None) -> pb.PublishResponse:
        """Publish; if the reply is lost, find out from the hub whether it landed.

        A publish that failed on a broken connection (`Unavailable`: the replica in use died,
        the channel moves to another) and that the check finds did not land is sent once
        more (`PUBLISH_RESEND`): nothing of it was written, so a second attempt is a fresh
        publish. Should the first attempt land after the check after all, the second finds
        `latest` at v, and a last check tells whether that version is ours.
        """
        attempts = 0

        def attempt() -> pb.PublishResponse:
            nonlocal attempts
            attempts += 1
            try:
                return self._rpc("Publish", request, timeout)
            except StaleVersion:
                again = self._landed(request, None) if attempts > 1 else None
                if again is None:
                    raise
                return again
            except (Unavailable, DeadlineExceeded, OutcomeUnknown) as exc:
                landed = self._landed(request, exc)
                if landed is not None:
                    return landed
                what = f"publish of {request.model}@{request.version}"
                if attempts == 1 and isinstance(exc, Unavailable):
                    log.info("%s: %s; sending it again", what, exc)
                    raise _Resend(f"{what} did not land ({exc})") from exc
                if attempts == 1:
                    raise OutcomeUnknown(
                        f"{what} not confirmed ({exc}); it did not land by the time of the "
                        "check; publish again"
                    ) from exc
                raise OutcomeUnknown(
                    f"{what} not confirmed after a second attempt ({exc}); publish again"
                ) from exc

        return self._policy.call(attempt, None)

    def _landed(
        self, request: pb.PublishRequest, exc: TensorHubError | None
    ) -> pb.PublishResponse | None:
        """What the hub says of an unconfirmed publish: its response if our holder record is
        there, None if the version is not there at all; `OutcomeUnknown` if it cannot tell
        (a shard, which is invisible until the last one; another publisher's version)."""
        if request.shard_count:  # an invisible shard cannot be looked up: say so
            raise OutcomeUnknown(
                f"shard {request.shard_index} of {request.model}@{request.version}: {exc}"
            ) from exc
        try:
            info = self._reads.inspect(request.model, request.version)
        except VersionNotFound:
            return None
        except TensorHubError as inner:
            raise OutcomeUnknown(
                f"publish of {request.model}@{request.version}: {exc}; {inner}"
            ) from exc
        mine = (self._me.holder_name, self._records.session_id)
        if any((h.name, h.session_id) == mine for h in info.holders):
            return pb.PublishResponse(
                version=request.version, revision=info.published_revision, visible=True
            )
        if exc is None:  # the version exists, and it is not ours: stale after all
            return None
        raise OutcomeUnknown(f"publish of {request.model}@{request.version}: {exc}") from exc


def _contiguous(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    own: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgument(f"{name!r} is not a tensor")
        own[name] = tensor.detach()
        if not own[name].is_contiguous():
            log.info("tensor %r is not contiguous: publishing a contiguous copy", name)
            own[name] = own[name].contiguous()
    return own
