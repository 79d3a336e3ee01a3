"""`Hub.fetch`: a whole version, or one shard of it, read into new or existing tensors; the
steps after the Resolve (register, rounds, failover, COMPLETE) are the orchestrator's
(ros/client/orchestrator.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from ros.client.deadline import Deadline
from ros.client.delta_fetch import DeltaReader
from ros.client.handles import Handles, Held
from ros.client.holdings import Holdings
from ros.client.manifest import layout_of
from ros.client.orchestrator import Orchestrator, ProgressCallback, Target
from ros.metrics import SDK_BYTES_FETCHED, SDK_FETCH_SECONDS
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument
from tensorhub.names import validate_name, validate_version
from transport.outcome import FetchStats
from transport.pace import DEFAULT_RATE_FLOOR
from transport.store import HeldVersion

DEFAULT_FETCH_TIMEOUT = 60.0


def fetch(
    runs: Orchestrator,
    holdings: Holdings,
    handles: Handles,
    model: str,
    version: int | str = "latest",
    *,
    into: Mapping[str, torch.Tensor] | None = None,
    timeout: float = DEFAULT_FETCH_TIMEOUT,
    shard: int | None = None,
    rate_floor: float = DEFAULT_RATE_FLOOR,
    progress: ProgressCallback | None = None,
    deltas: DeltaReader | None = None,
    base: int | None = None,
    resolved: pb.ResolveResponse | None = None,
    expect: Callable[[pb.Manifest], None] | None = None,
) -> Held:
    """`Hub.fetch` (its docstring says what a caller gets): check the arguments, resolve, build the
    destination (`into`'s own memory, or new tensors, never memory `holdings` still serves),
    apply what deltas it can when `deltas` is given and the destination holds an earlier
    version (`base`, or the one `deltas` knows `into` holds; the companion of the deltas is
    resolved with the version), and let `runs` fill in the rest; `handles` makes the `Held`
    it returns. `resolved`: a Resolve of exactly this version and shard answered just now
    (a companion's, with its version's), used instead of resolving again. `expect` is
    shown the manifest before anything is allocated or read, and may refuse it by raising
    (a companion of another size than its version states: `delta_chunks.check_companion`)."""
    if base is not None:
        validate_version(base)
    validate_name(model, "model")
    number = 0 if version == "latest" else validate_version(version)
    check_shard_arg(shard)
    start = time.monotonic()
    deadline = Deadline.after(timeout, f"fetch {model}@{version}")
    if deltas is not None and into is not None and base is None:
        base = deltas.bases.version_in(model, shard, into)
    with_companion = deltas is not None and into is not None and base is not None
    if resolved is None or not number or int(resolved.version) != number:
        resolved = runs.resolve(model, number, shard, deadline, companion=with_companion)
    version = int(resolved.version)
    manifest = manifest_of_shard(model, version, resolved, shard)
    if expect is not None:
        expect(manifest)
    layout = layout_of(manifest)
    if into is not None:
        layout.check_tensors(into)
        holdings.check_free(into)
        tensors = {spec.name: into[spec.name] for spec in layout.tensors}
    else:
        tensors = layout.allocate()
    held = HeldVersion.reader(holdings.tenant, model, version, layout, tensors)
    applied = None
    if deltas is not None and into is not None and manifest.HasField("delta") and base is not None:
        companion = resolved.companion if resolved.HasField("companion") else None
        applied = deltas.apply(model, shard, manifest, held, base, deadline, companion=companion)
    target = Target(model, version, shard, held, manifest)
    try:
        stats = runs.run(target, resolved, deadline, rate_floor=rate_floor, progress=progress)
    except BaseException:
        if applied is not None and applied.keep is not None:
            applied.keep.release(force=True)
        raise
    for source, nbytes in stats.bytes_per_source.items():  # the companions count their own
        SDK_BYTES_FETCHED.labels(source).inc(nbytes)
    if applied is not None:  # one account of the fetch: the encoded bytes and who sent them
        stats.encoded_bytes += applied.stats.encoded_bytes
        for source, nbytes in applied.stats.bytes_per_source.items():
            stats.bytes_per_source[source] = stats.bytes_per_source.get(source, 0) + nbytes
    SDK_FETCH_SECONDS.observe(time.monotonic() - start)
    out = handles.held(model, version, tensors, stats, shard)
    if applied is not None:
        out.delta, out.companion = applied.stats, applied.keep
    if deltas is not None:
        deltas.bases.remember(model, shard, version, tensors)
    return out


def fetch_unheld(
    runs: Orchestrator,
    tenant: str,
    model: str,
    version: int,
    *,
    shard: int | None,
    timeout: float,
    expect: Callable[[pb.Manifest], None] | None = None,
) -> tuple[dict[str, torch.Tensor], FetchStats]:
    """Read `model@version` (shard `shard`) whole into new tensors as no holder: nothing is
    registered or served, and nothing pins it (a version retired meanwhile fails the read).
    How a `fetch_slices` reader, which holds nothing, reads a delta's encoded chunks.
    `expect` is `fetch`'s."""
    deadline = Deadline.after(timeout, f"read {model}@{version}")
    resolved = runs.resolve(model, version, shard, deadline)
    manifest = manifest_of_shard(model, version, resolved, shard)
    if expect is not None:
        expect(manifest)
    layout = layout_of(manifest)
    tensors = layout.allocate()
    dest = HeldVersion.reader(tenant, model, version, layout, tensors)
    target = Target(model, version, shard, dest, manifest, holder=False)
    return tensors, runs.run(target, resolved, deadline)


def manifest_of_shard(
    model: str, version: int, resolved: pb.ResolveResponse, shard: int | None
) -> pb.Manifest:
    """The manifest to read: the whole version's, or shard `shard`'s of a model-parallel one
    (a Resolve with `shard` answers only that shard's manifest, in `manifest`)."""
    count = resolved.shard_count or len(resolved.shards)
    if not count:
        if shard is not None:
            raise InvalidArgument(f"{model}@{version} is not model-parallel: omit shard")
        return resolved.manifest
    if shard is None:
        raise InvalidArgument(
            f"{model}@{version} is model-parallel ({count} shards): fetch one with shard=i "
            f"(0 <= i < {count}), or read blocks in another layout with fetch_slices"
        )
    if not 0 <= shard < count:
        raise InvalidArgument(f"shard {shard!r} out of range: {model}@{version} has {count}")
    manifest: pb.Manifest = resolved.shards[shard] if resolved.shards else resolved.manifest
    return manifest


def check_shard_arg(shard: int | None) -> None:
    """Refuse a shard that is no index before asking the hub (a bool is no index)."""
    if shard is not None and (isinstance(shard, bool) or not isinstance(shard, int) or shard < 0):
        raise InvalidArgument(f"shard {shard!r} out of range: a shard is an integer >= 0")
