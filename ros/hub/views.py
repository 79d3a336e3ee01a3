"""The hub's side of views (docs/views.md): a Publish's views checked; their admission
to the models quota is `ros.hub.budget.Budgets.admission_of`.

A view of `model@v` is version v of `{model}.{fmt}` (`tensorhub.view_rules`), published only
inside the Publish of `model@v` (`PublishRequest.views`) and committed in its transaction
(`consistency.view_publish`). So:

- a Publish naming a view model itself is refused (`InvalidName`): no view exists without
  its version, and no one publishes a view of a version that is not theirs;
- views ride on whole versions only: a shard's Publish with views is refused
  (`InvalidArgument`), as is a delta companion's;
- each view's format is known and asked once, its manifest passes every rule
  (`ros.manifest_check`: a delta section too, against the view's own companion) and its
  size bound, and names its format in its metadata.

The cost on a Publish without views: one suffix test of the model's name.
"""

from __future__ import annotations

from consistency import ops
from consistency.manifests import INLINE_BYTES, PAGE_BYTES, check_manifest_size
from consistency.shard_commit import MAX_TXN_OPS
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
    shard or a delta companion. Nothing else for any other Publish."""
    found = view_of(request.model)
    if found is not None:
        model, fmt = found
        raise InvalidName(
            f"model {request.model!r}: names ending in '.{fmt}' are reserved for views; "
            f"publish {model!r} with views=('{fmt}',)"
        )
    if not request.views:
        return
    if request.shard_count:
        raise InvalidArgument(
            f"{request.model}@{request.version}: views of a model-parallel version are not "
            "supported; publish views with whole versions"
        )
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


def _pages(size: int) -> int:
    return 0 if size <= INLINE_BYTES else -(-size // PAGE_BYTES)


def views_charge(views: list[tuple[str, bytes]]) -> int:
    """The bytes the views add to their version's etcd charge: what retention gives back
    when it deletes each view version (its manifest and one record)."""
    return sum(len(manifest) + RECORD_BYTES for _, manifest in views)
