"""Manifests: a version's layout plus the publisher's checksum of every chunk.

The checksums are computed once by the publisher over its own memory, so a reader can check
the bytes it received against the version as published, end to end, not just against what
one holder claims to have sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument
from transport.boxes import Box
from transport.checksums import KINDS, WSUM64, XXH3
from transport.layout import Layout, TensorSpec
from transport.store import HeldVersion

Placements = Mapping[str, tuple[Sequence[int], Sequence[int]]]


def manifest_of(
    held: HeldVersion, placements: Placements | None = None, checksum: str | None = None
) -> pb.Manifest:
    """The manifest of a version held complete in memory (computes chunk checksums).

    `placements` maps a tensor name to (global shape, offsets): the block of a global
    tensor that this (model-parallel) rank holds. Checked before anything is computed.
    `checksum` is the chunk checksum's algorithm (`transport.checksums`): `xxh3-64`, or
    `wsum64`, computed where the tensors are; None picks `wsum64` for tensors in GPU memory
    (no copy of the model to the host) and `xxh3-64` for host memory.
    """
    layout = held.layout
    boxes = _check_placements(layout, placements or {})
    kind = (WSUM64 if held.on_cuda else XXH3) if checksum is None else checksum
    if kind not in KINDS:
        raise InvalidArgument(f"checksum {checksum!r}: one of {', '.join(KINDS)}")
    if kind == WSUM64:
        sums = [held.wsum64(i) for i in range(layout.num_chunks)]
    else:
        held.precompute_checksums()
        sums = [held.checksum(i) for i in range(layout.num_chunks)]
    return pb.Manifest(
        tensors=[
            pb.TensorEntry(
                name=s.name,
                dtype=s.dtype,
                shape=list(s.shape),
                offset=s.offset,
                nbytes=s.nbytes,
                global_shape=list(boxes[s.name][0]) if s.name in boxes else [],
                global_offsets=list(boxes[s.name][1].offsets) if s.name in boxes else [],
            )
            for s in layout.tensors
        ],
        total_bytes=layout.total_bytes,
        chunk_size=layout.chunk_size,
        chunk_xxh3=sums,
        checksum="" if kind == XXH3 else kind,  # "" reads as xxh3-64 everywhere
    )


def _check_placements(
    layout: Layout, placements: Placements
) -> dict[str, tuple[tuple[int, ...], Box]]:
    shapes = {s.name: s.shape for s in layout.tensors}
    out: dict[str, tuple[tuple[int, ...], Box]] = {}
    for name, (global_shape, offsets) in placements.items():
        if name not in shapes:
            raise InvalidArgument(f"placement for {name!r}, which is not among the tensors")
        glob = tuple(int(d) for d in global_shape)
        box = Box(tuple(int(o) for o in offsets), shapes[name])
        if not box.within(glob):
            raise InvalidArgument(
                f"tensor {name!r} of shape {shapes[name]} at offsets {box.offsets} does not fit "
                f"in its global shape {glob}"
            )
        out[name] = (glob, box)
    return out


def placement_of(entry: pb.TensorEntry) -> tuple[tuple[int, ...], Box]:
    """The global shape of a manifest entry's tensor and the box this entry holds of it."""
    shape = tuple(int(d) for d in entry.shape)
    if not entry.global_shape:
        return shape, Box((0,) * len(shape), shape)
    glob = tuple(int(d) for d in entry.global_shape)
    box = Box(tuple(int(o) for o in entry.global_offsets), shape)
    if not box.within(glob):
        raise InvalidArgument(f"manifest entry {entry.name!r}: its block exceeds {glob}")
    return glob, box


def layout_of(manifest: pb.Manifest) -> Layout:
    """The transport layout a manifest describes; `InvalidArgument` if it is inconsistent."""
    layout = Layout(
        tuple(
            TensorSpec(t.name, t.dtype, tuple(int(d) for d in t.shape), t.offset, t.nbytes)
            for t in manifest.tensors
        ),
        manifest.total_bytes,
        manifest.chunk_size,
    )
    if len(manifest.chunk_xxh3) != layout.num_chunks:
        raise InvalidArgument(
            f"manifest has {len(manifest.chunk_xxh3)} checksums for {layout.num_chunks} chunks"
        )
    return layout
