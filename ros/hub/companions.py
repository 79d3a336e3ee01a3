"""The hub's reservation of delta companion names (`{model}.delta`, `tensorhub.delta_rules`).

A delta version `model@v` is served by its companion `{model}.delta@v`, which the SDK
publishes first, from the same session, with the delta's base `b` named in the companion's
metadata (`ros.client.publishing`), and encodes against its own copy of `model@b`: a
version this same client published. So the hub accepts a Publish of a companion name only
as that step of a delta publish:

- the name is `{model}.delta` of a model that is not itself a companion;
- its metadata names that model (`DELTA_OF`) and a base `b` before the version
  (`DELTA_BASE`);
- the publishing session is the one that published `model@b` (of a model-parallel
  version: the same shard of it), as the base's header records (`PartHeader.session`).

Anything else is `InvalidName`, before anything is written. So a raw Publish to a companion
name, or a companion published ahead of the real publisher by another session of the
tenant, is refused, and the real publisher's own companion is not displaced by one.

What it does not stop: a client of the tenant that passes the publisher's own session id
(holder records, and so session ids, are visible to every client of the tenant). Such a
client can publish `model@v` itself too; the tenant, not the session, is the boundary
(docs/security.md).

The cost: nothing on a Publish of any other name (a suffix test). A companion's Publish
reads the base's header from the replica's cache: the base was published through this
replica (a whole version seeds it there), or resolved through it; else one etcd read.
"""

from __future__ import annotations

from collections.abc import Callable

from consistency.manifests import ManifestHeader
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.delta_rules import SUFFIX, is_companion
from tensorhub.errors import InvalidName, VersionNotFound
from tensorhub.names import MAX_VERSION

DELTA_OF = "tensorhub.delta-of"  # a companion's metadata: the model it is the delta of
DELTA_BASE = "tensorhub.delta-base"  # ... and the version its delta is against

HeaderOf = Callable[[str, int], ManifestHeader]  # (model, version) -> its header


def check_companion(request: pb.PublishRequest, header_of: HeaderOf) -> None:
    """Refuse (`InvalidName`) a Publish of a companion name that is not the companion step
    of a delta publish by the session that published its base (module docstring); nothing
    for any other name. `header_of` reads a published version's header (cached)."""
    name = request.model
    if not is_companion(name):
        return
    model = name[: -len(SUFFIX)]
    what = f"{name!r}: names ending in {SUFFIX!r} are reserved for the delta companions"
    if not model or is_companion(model):
        raise InvalidName(f"{what} of a model that is not one itself")
    metadata = request.manifest.metadata
    if metadata.get(DELTA_OF) != model:
        raise InvalidName(f"{what}: a companion's metadata names {DELTA_OF} = {model!r}")
    base = _base(metadata.get(DELTA_BASE, ""))
    if not 1 <= base < request.version:
        raise InvalidName(
            f"{what}: a companion's metadata names its base ({DELTA_BASE}), a version of "
            f"{model!r} before {request.version}"
        )
    shard = request.shard_index if request.shard_count else None
    try:
        header = header_of(model, base)
    except VersionNotFound as exc:
        raise InvalidName(f"{what}: its base {model}@{base} is not published") from exc
    session = request.holder.session_id
    if not session:
        raise InvalidName(f"{what}: a companion names its publisher's session")
    if header.shard_count != request.shard_count:
        raise InvalidName(
            f"{what}: {model}@{base} has {header.shard_count} shards, this companion "
            f"{request.shard_count}"
        )
    if header.publisher(shard) != session:
        part = f"{model}@{base}" if shard is None else f"shard {shard} of {model}@{base}"
        raise InvalidName(
            f"{what} of a delta publish: only the session that published {part} may publish "
            f"its delta's companion"
        )


def _base(text: str) -> int:
    """The base a companion's metadata names; 0 if it is not a version number."""
    if not text.isascii() or not text.isdigit() or len(text) > len(str(MAX_VERSION)):
        return 0
    return int(text)
