"""`Hub.fetch`: a whole version, or one shard of it, read into new or existing tensors; the
steps after the Resolve (register, rounds, failover, COMPLETE) are the orchestrator's
(ros/client/orchestrator.py), and so is the read of a delta's companion
(ros/client/delta_fetch.py), under the fetch's one `Deadline`."""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from ros.client.deadline import Deadline
from ros.client.delta_fetch import DeltaReader
from ros.client.handles import Handles, Held
from ros.client.holdings import Holdings
from ros.client.manifest import layout_of
from ros.client.orchestrator import Orchestrator, ProgressCallback, Target, manifest_of_shard
from ros.metrics import SDK_BYTES_FETCHED, SDK_FETCH_SECONDS
from tensorhub.errors import InvalidArgument
from tensorhub.names import validate_name, validate_version
from transport.pace import DEFAULT_RATE_FLOOR
from transport.store import HeldVersion

__all__ = ["DEFAULT_FETCH_TIMEOUT", "check_shard_arg", "fetch", "manifest_of_shard"]

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
) -> Held:
    """`Hub.fetch` (its docstring says what a caller gets): check the arguments, resolve, build the
    destination (`into`'s own memory, or new tensors, never memory `holdings` still serves),
    apply what deltas it can when `deltas` is given and the destination holds an earlier
    version (`base`, or the one `deltas` knows `into` holds; the companion of the deltas is
    resolved with the version), and let `runs` fill in the rest; `handles` makes the `Held`
    it returns."""
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
    resolved = runs.resolve(model, number, shard, deadline, companion=with_companion)
    version = int(resolved.version)
    manifest = manifest_of_shard(model, version, resolved, shard)
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
    if applied is not None:  # one account of the fetch: the encoded bytes and who sent them
        stats.encoded_bytes += applied.stats.encoded_bytes
        for source, nbytes in applied.stats.bytes_per_source.items():
            stats.bytes_per_source[source] = stats.bytes_per_source.get(source, 0) + nbytes
    for source, nbytes in stats.bytes_per_source.items():
        SDK_BYTES_FETCHED.labels(source).inc(nbytes)
    SDK_FETCH_SECONDS.observe(time.monotonic() - start)
    out = handles.held(model, version, tensors, stats, shard)
    if applied is not None:
        out.delta, out.companion = applied.stats, applied.keep
    if deltas is not None:
        deltas.bases.remember(model, shard, version, tensors)
    return out


def check_shard_arg(shard: int | None) -> None:
    """Refuse a shard that is no index before asking the hub (a bool is no index)."""
    if shard is not None and (isinstance(shard, bool) or not isinstance(shard, int) or shard < 0):
        raise InvalidArgument(f"shard {shard!r} out of range: a shard is an integer >= 0")
