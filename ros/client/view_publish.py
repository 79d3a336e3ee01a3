"""The views a publish makes (docs/views.md): each quantized where the tensors are, held as
a version of its own model (`{model}.{fmt}`, `tensorhub.view_rules`), and sent in the
version's own Publish (`PublishRequest.views`), which the hub commits in one etcd
transaction with the version (`consistency.view_publish`): visible together or not at all.

Each view holds, beyond the version, its quantized weights and scales (about half the bytes
of the weights it quantizes); its other tensors are the version's own, not copies.

A rank's shard of a model-parallel version carries its shard of each view in its own
Publish (`make_shard_view_versions`: its blocks quantized, the scales of blocks split across
ranks agreed over their process group, `ros.views.shard_view`); the hub commits the view
shards with the version's and makes the views visible with it (`consistency.shard_commit`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ros.client.dtensors import has_dtensors
from ros.client.group_publish import ProcessGroup
from ros.client.manifest import Placements, manifest_of
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.views import make_view
from ros.views.shard_view import make_shard_views
from tensorhub.view_rules import check_views, view_model
from transport.layout import Layout
from transport.store import HeldVersion

VIEW_OF = "tensorhub.view-of"  # a view manifest's metadata: the model it is a view of


@dataclass(frozen=True)
class MadeView:
    """One view of a version: its format, what its publisher holds, and its manifest."""

    fmt: str
    held: HeldVersion
    manifest: pb.Manifest


def check_publish_views(model: str, views: Sequence[str]) -> list[str]:
    """The formats of `views=` (each known, once; `InvalidArgument` else)."""
    if not views:
        return []
    return check_views(model, views if isinstance(views, str) else list(views))


def is_model_parallel(
    tensors: Mapping[str, torch.Tensor],
    shard: tuple[int, int] | None,
    placements: Placements | None,
    group: ProcessGroup | None,
) -> bool:
    """Whether a publish is one rank's shard (a shard, placements, a process group or a
    state dict of DTensors): its views are then made with the other ranks
    (`make_shard_view_versions`)."""
    return shard is not None or bool(placements) or group is not None or has_dtensors(tensors)


def make_views(
    tenant: str,
    model: str,
    version: int,
    tensors: Mapping[str, torch.Tensor],
    formats: Sequence[str],
    chunk_size: int,
    checksum: str | None,
    metadata: Mapping[str, str] | None,
) -> list[MadeView]:
    """Each view of `tensors` (`ros.views.make_view`, on their device), held as version
    `version` of its view model, with its manifest: its chunks of `chunk_size` (the
    version's), `checksum`, and the version's `metadata` (its config files travel with it)
    plus the view's own (format, `quantization_config`, what was quantized)."""
    made: list[MadeView] = []
    for fmt in formats:
        tensors_of, view_metadata = make_view(tensors, fmt)
        name = view_model(model, fmt)
        layout = Layout.from_tensors(tensors_of, chunk_size)
        held = HeldVersion.publisher(tenant, name, version, tensors_of, layout)
        manifest = manifest_of(held, None, checksum)
        manifest.metadata.update(metadata or {})
        manifest.metadata.update(view_metadata)
        manifest.metadata[VIEW_OF] = model
        made.append(MadeView(fmt, held, manifest))
    return made


def make_shard_view_versions(
    tenant: str,
    model: str,
    version: int,
    tensors: Mapping[str, torch.Tensor],
    placements: Placements | None,
    formats: Sequence[str],
    group: ProcessGroup | None,
    chunk_size: int,
    checksum: str | None,
    metadata: Mapping[str, str] | None,
) -> list[MadeView]:
    """This rank's shard of each view of a model-parallel version (`make_shard_views`:
    collective over `group`, the default group when None), each held as version `version`
    of its view model with its manifest (its blocks' placements, the view's metadata)."""
    made: list[MadeView] = []
    shards = make_shard_views(tensors, placements or {}, formats, group)
    for fmt in formats:
        view = shards[fmt]
        layout = Layout.from_tensors(view.tensors, chunk_size)
        held = HeldVersion.publisher(tenant, view_model(model, fmt), version, view.tensors, layout)
        manifest = manifest_of(held, view.placements, checksum)
        manifest.metadata.update(metadata or {})
        manifest.metadata.update(view.metadata)
        manifest.metadata[VIEW_OF] = model
        made.append(MadeView(fmt, held, manifest))
    return made
