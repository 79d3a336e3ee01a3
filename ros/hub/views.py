"""The hub's side of views (docs/views.md): a Publish's views checked; their admission
to the models quota is `ros.hub.budget.Budgets.admission_of`.

A view of `model@v` is version v of `{model}.{fmt}` (`tensorhub.view_rules`), published only
inside the Publish of `model@v` (`PublishRequest.views`) and committed in its transaction
(`consistency.view_publish`). So:

- a Publish naming a view model itself is refused (`InvalidName`): no view exists without
  its version, and no one publishes a view of a version that is not theirs;
- a shard's Publish carries its rank's shard of each view, committed in its batch and made
  visible with the version (`consistency.shard_commit`, docs/views.md "Views of
  model-parallel versions"); a delta companion's Publish with views is refused
  (`InvalidArgument`);
- each view's format is known and asked once, its manifest passes every rule
  (`ros.manifest_check`: a delta section too, against the view's own companion) and its
  size bound, and names its format in its metadata.

The cost on a Publish without views: one suffix test of the model's name.
"""

from __future__ import annotations

from consistency import ops
from consistency.manifests import (
    INLINE_BYTES,
    PAGE_BYTES,
    SHARD_INLINE_BYTES,
    check_manifest_size,
)
from consistency.shard_entries import FIXED_OPS, MAX_TXN_OPS
from consistency.usage import RECORD_BYTES
from ros.manifest_check import check_manifest
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.delta_rules import is_companion
from tensorhub.errors import InvalidArgument, InvalidManifest, InvalidName, ManifestTooLarge
from tensorhub.view_rules import MAX_VIEWS, check_format, view_model, view_of

META_FORMAT = "tensorhub.view"  # a view manifest's metadata: its format (`ros.views`)

Guard = tuple[list[ops.Cmp], list[ops.Op]]
TXN_OWN_OPS = 8  # a whole publish's own writes: budget, fence, header, holder, latest, ...


def refuse_view_name(request: pb.PublishRequest) -> None:
    """`InvalidName` for a Publish of a view model's name; `InvalidArgument` for views on a
    delta companion. Nothing else for any other Publish."""
    found = view_of(request.model)
    if found is not None:
        model, fmt = found
        raise InvalidName(
            f"model {request.model!r}: names ending in '.{fmt}' are reserved for views; "
            f"publish {model!r} with views=('{fmt}',)"
        )
    if not request.views:
        return
    if is_companion(request.model):
        raise InvalidArgument(f"{request.model!r}: a delta companion has no views")


def checked_views(request: pb.PublishRequest) -> list[tuple[str, bytes]]:
    """(view model, manifest bytes) of each view of a whole Publish, every rule checked
    before any write (module docstring)."""
    if len(request.views) > MAX_VIEWS:
        raise InvalidArgument(f"{len(request.views)} views: at most {MAX_VIEWS}, one per format")
    out: list[tuple[str, bytes]] = []
    seen: set[str] = set()
    for view in request.views:
        fmt = check_format(view.format)
        if fmt in seen:
            raise InvalidArgument(f"view {fmt!r} asked for twice")
        seen.add(fmt)
        name = view_model(request.model, fmt)
        what = f"manifest of the {fmt} view"
        check_manifest_size(view.manifest.ByteSize(), what)
        check_manifest(view.manifest, what, model=name, version=request.version)
        if view.manifest.metadata.get(META_FORMAT) != fmt:
            raise InvalidManifest(f"{what}: its metadata must name {META_FORMAT} = {fmt!r}")
        out.append((name, view.manifest.SerializeToString()))
    return out


def check_pages(manifest_bytes: int, views: list[tuple[str, bytes]]) -> None:
    """`ManifestTooLarge`, before any write, when the version's and its views' manifest
    pages would take more operations than one etcd transaction allows (`--max-txn-ops`,
    128: each page is one commit and one compare, each view 3 writes and 1 compare, the
    version's own writes and compares a few more)."""
    pages = _pages(manifest_bytes) + sum(_pages(len(m)) for _, m in views)
    ops_needed = pages + 3 * len(views) + TXN_OWN_OPS
    if ops_needed > MAX_TXN_OPS:
        raise ManifestTooLarge(
            f"the manifests of the version and its {len(views)} views take {pages} pages of "
            f"{PAGE_BYTES} bytes: with them, its transaction would take {ops_needed} "
            f"operations, past etcd's {MAX_TXN_OPS}; publish fewer views"
        )


def check_shard_pages(manifest_bytes: int, views: list[tuple[str, bytes]]) -> None:
    """`ManifestTooLarge`, before any write, when a shard's manifest pages and its view
    shards' would not fit one batch's transaction by themselves (each view shard 2 writes
    and its pages, each view's header and `latest` 2 more, the batch's own writes 5)."""
    pages = _shard_pages(manifest_bytes) + sum(_shard_pages(len(m)) for _, m in views)
    ops_needed = FIXED_OPS + 2 + pages + 4 * len(views)
    if ops_needed > MAX_TXN_OPS:
        raise ManifestTooLarge(
            f"the manifests of the shard and its {len(views)} view shards take {pages} pages "
            f"of {PAGE_BYTES} bytes: with them, its batch would take {ops_needed} operations, "
            f"past etcd's {MAX_TXN_OPS}; publish fewer views or smaller shards"
        )


def _shard_pages(size: int) -> int:
    return 0 if size <= SHARD_INLINE_BYTES else -(-size // PAGE_BYTES)


def _pages(size: int) -> int:
    return 0 if size <= INLINE_BYTES else -(-size // PAGE_BYTES)


def views_charge(views: list[tuple[str, bytes]]) -> int:
    """The bytes the views add to their version's etcd charge: what retention gives back
    when it deletes each view version (its manifest and one record)."""
    return sum(len(manifest) + RECORD_BYTES for _, manifest in views)
