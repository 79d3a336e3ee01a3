"""Which part of which source shard each slice takes (`ros.client.slices`: a reader of
slices reads, from each source shard, only the chunks that hold its intersection with the
blocks it wants).

`SliceRead` is what every step of one read shares (who reads which version, from whom,
by when); `plan_copies` covers each slice exactly once from the source shards' placements
(a `Copy` per block part), `needed_chunks` names the chunks of a source shard's layout those
parts lie in, `shard_order` says in which order the source shards are read, and
`SliceRead.source` names a source shard's holders and layout (`SourceShard`).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ros.client.deadline import Deadline
from ros.client.identity import Identity
from ros.client.manifest import layout_of, placement_of
from ros.client.orchestrator import Orchestrator, ProgressCallback
from ros.client.slice import Slice
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument
from transport.boxes import Box, byte_span, chunks_for
from transport.layout import Layout, TensorSpec, dtype_name, torch_dtype


@dataclass
class Copy:
    """One source shard's part of a slice: the block of the global tensor `name` the shard
    holds (`source`) and its intersection with the slice (`part`), in global coordinates."""

    name: str
    source: Box  # the block the source shard holds
    part: Box  # the intersection to copy


def plan_copies(
    model: str, version: int, parts: list[pb.Manifest], slices: Mapping[str, Slice]
) -> dict[int, list[Copy]]:
    """Which blocks to copy from which source shard, each slice covered exactly once: the
    blocks of a split tensor add up to it; a whole (replicated) one is read from one shard."""
    plan: dict[int, list[Copy]] = {}
    entries = [{e.name: e for e in manifest.tensors} for manifest in parts]
    for name, want in slices.items():
        box = want.box
        covered = 0
        known = False
        for index, by_name in enumerate(entries):
            entry = by_name.get(name)
            if entry is None:
                continue
            known = True
            glob, held = placement_of(entry)
            _check_slice(model, version, name, want, entry, glob)
            common = held.intersect(box)
            if covered >= box.volume or common is None or common.volume == 0:
                continue
            plan.setdefault(index, []).append(Copy(name, held, common))
            covered += common.volume
        if not known:
            raise InvalidArgument(f"{model}@{version} has no tensor {name!r}")
        if covered != box.volume:
            raise InvalidArgument(
                f"{name!r}: the shards of {model}@{version} cover {covered} of the "
                f"{box.volume} elements asked for (overlapping or missing blocks)"
            )
    return plan


def _check_slice(
    model: str,
    version: int,
    name: str,
    want: Slice,
    entry: pb.TensorEntry,
    glob: tuple[int, ...],
) -> None:
    if tuple(int(d) for d in want.global_shape) != glob:
        raise InvalidArgument(
            f"{name!r}: global shape {tuple(want.global_shape)} asked, {model}@{version} has {glob}"
        )
    if dtype_name(want.tensor.dtype) != entry.dtype:
        raise InvalidArgument(f"{name!r}: dtype {want.tensor.dtype}, published {entry.dtype}")
    if not want.box.within(glob):
        raise InvalidArgument(f"{name!r}: block {want.box} is outside the global shape {glob}")


def needed_chunks(
    copies: Sequence[Copy], layout: Layout, specs: Mapping[str, TensorSpec]
) -> set[int]:
    """The chunks of a source shard's `layout` that hold the parts `copies` take."""
    needed: set[int] = set()
    for c in copies:
        spec = specs[c.name]
        first, end = byte_span(c.source, c.part, torch_dtype(spec.dtype).itemsize)
        needed.update(chunks_for(layout, spec, first, end))
    return needed


def shard_order(plan: Mapping[int, list[Copy]]) -> list[int]:
    """The source shards of `plan` in order, from a random one on: readers that start at
    once start on different shards when there are more than `slice_read.SHARDS_AT_ONCE`."""
    order = sorted(plan)
    first = secrets.randbelow(len(order))
    return order[first:] + order[:first]


@dataclass(frozen=True)
class SourceShard:
    """One source shard as its reads take it: its `index` among the read's `parts`, its
    `shard` number (None: a version published whole), the hub's answer naming its
    `holders`, its `manifest` and that manifest's `layout` (`specs`: its tensors by name)."""

    index: int
    shard: int | None
    holders: pb.ResolveResponse
    manifest: pb.Manifest
    layout: Layout
    specs: Mapping[str, TensorSpec]


@dataclass(frozen=True)
class SliceRead:
    """What every step of one read of slices (`ros.client.slices.fetch_slices`) shares: the
    client's orchestrator (`runs`) and identity (`me`), the version read (`model`@`version`)
    and the hub's answer that resolved it (`resolved`, its source shards' manifests:
    `parts`), the `slices` wanted (by name: each step looks up the ones its copies fill),
    the `deadline`, the `rate_floor` under which a holder counts slow, and the caller's
    `progress`. Built once per read and handed down whole, so that each step's signature
    names only what is its own (a source shard, its copies, its staging, what it adds up
    into); a step that reports progress another way (from threads: serialized; or not at
    all) takes a copy (`dataclasses.replace`)."""

    runs: Orchestrator
    me: Identity
    model: str
    version: int
    resolved: pb.ResolveResponse
    parts: list[pb.Manifest]
    slices: Mapping[str, Slice]
    deadline: Deadline
    rate_floor: float
    progress: ProgressCallback | None = None

    def plan(self, slices: Mapping[str, Slice]) -> dict[int, list[Copy]]:
        """`plan_copies` of `slices` (the read's, or some of them) over the read's shards."""
        return plan_copies(self.model, self.version, self.parts, slices)

    def shard_of(self, index: int) -> int | None:
        """The shard number of source part `index` (None: a version published whole)."""
        return index if self.resolved.shards else None

    def layout(self, index: int) -> tuple[Layout, dict[str, TensorSpec]]:
        """Source part `index`'s layout and its tensors by name."""
        layout = layout_of(self.parts[index])
        return layout, {spec.name: spec for spec in layout.tensors}

    def holders(self, index: int) -> pb.ResolveResponse:
        """The holders of source part `index` (a Resolve answers candidates of one shard
        only: the read's own answer for a version published whole)."""
        shard = self.shard_of(index)
        if shard is None:
            return self.resolved
        return self.runs.holders(self.model, self.version, shard, self.deadline)

    def source(self, index: int) -> SourceShard:
        """Source part `index` as its reads take it, with the holders the hub names now."""
        layout, specs = self.layout(index)
        holders = self.holders(index)
        return SourceShard(index, self.shard_of(index), holders, self.parts[index], layout, specs)
