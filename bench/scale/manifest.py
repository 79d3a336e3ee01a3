"""Manifest: publish and fetch (SDK) one version of 100,000 tensors in 300,000 chunks,
against an etcd at its default 1.5 MiB request limit.

The SDK's smallest chunk is `transport.layout.MIN_CHUNK` (4 KiB), so 300,000 chunks are
1.2 GB: 100,000 uint8 tensors of 12 KiB, all views of one buffer. The reader is a second SDK
client in this process. Figures: publish time, fetch time, etcd writes (revision delta), the
keys and bytes (key + value) the publish left in etcd, and the DB file's growth. A publish
or fetch that fails (e.g. a hub without paged manifests) is reported as the part's failure,
with what was measured before it, not raised.
"""

from __future__ import annotations

import time
from typing import Any

from bench.scale.procs import etcd_bytes_since
from bench.scale.world import World
from transport.layout import ALIGN, MIN_CHUNK

MODEL = "manifest"


def run(tensors: int = 100_000, chunks: int = 300_000, timeout: float = 300.0) -> dict[str, Any]:
    """The manifest part on its own etcd and hub (default limits)."""
    import torch

    import ros

    each = max(ALIGN, (chunks * MIN_CHUNK // tensors) // ALIGN * ALIGN)
    out: dict[str, Any] = {
        "tensors": tensors,
        "chunk_size": MIN_CHUNK,
        "tensor_bytes": each,
        "chunks": -(-tensors * each // MIN_CHUNK),
    }
    buffer = torch.zeros(tensors * each, dtype=torch.uint8)
    rows = buffer.view(tensors, each)
    weights = {f"t{i:06d}": rows[i] for i in range(tensors)}
    with World() as world:
        pub = ros.connect(world.address, tenant=world.tenant, token=world.token, timeout=timeout)
        reader = ros.connect(world.address, tenant=world.tenant, token=world.token, timeout=timeout)
        try:
            st0 = world.status()
            t0 = time.monotonic()
            try:
                publication = pub.publish(MODEL, 1, weights, chunk_size=MIN_CHUNK, timeout=timeout)
            except ros.TensorHubError as exc:
                out["failed"] = f"publish: {type(exc).__name__}: {exc}"[:500]
                return out
            out["publish_s"] = time.monotonic() - t0
            st1 = world.status()
            out["etcd_writes"] = st1["revision"] - st0["revision"]
            out["etcd_db_bytes_delta"] = st1["db_size"] - st0["db_size"]
            keys, size = etcd_bytes_since(world.etcd_endpoint, st0["revision"])
            out["etcd_keys_written"], out["etcd_bytes_written"] = keys, size
            t1 = time.monotonic()
            try:
                held = reader.fetch(MODEL, 1, timeout=timeout)
            except ros.TensorHubError as exc:
                out["failed"] = f"fetch: {type(exc).__name__}: {exc}"[:500]
                return out
            out["fetch_s"] = time.monotonic() - t1
            out["fetched_tensors"] = len(held.tensors)
            held.release()
            publication.release(force=True)
        finally:
            reader.close()
            pub.close()
    return out
