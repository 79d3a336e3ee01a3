"""Manifests: a version's layout plus the publisher's checksum of every chunk.

The checksums are computed once by the publisher over its own memory, so a reader can check
the bytes it received against the version as published, end to end, not just against what
one holder claims to have sent.
"""

from __future__ import annotations

from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument
from transport.layout import Layout, TensorSpec
from transport.store import HeldVersion


def manifest_of(held: HeldVersion) -> pb.Manifest:
    """The manifest of a version held complete in memory (computes chunk checksums)."""
    layout = held.layout
    held.precompute_checksums()
    return pb.Manifest(
        tensors=[
            pb.TensorEntry(
                name=s.name, dtype=s.dtype, shape=list(s.shape), offset=s.offset, nbytes=s.nbytes
            )
            for s in layout.tensors
        ],
        total_bytes=layout.total_bytes,
        chunk_size=layout.chunk_size,
        chunk_xxh3=[held.checksum(i) for i in range(layout.num_chunks)],
    )


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
