"""Reading a model-parallel version in another layout (resharding: docs/design.md,
"Model-parallel versions").

Trainer ranks publish their shards with placements (the block of each global tensor a rank
holds). A reader in another layout — TP 8 → TP 32, or TP 2 → one whole model — names the
block it wants of each global tensor (`Slice`), and `fetch_slices` reads, from the holders
of each source shard, only the chunks that contain its intersection with that block, checks
them against the publisher's checksums, and copies the intersection into place.

Source shards are read `SHARDS_AT_ONCE` at a time (`ros.client.slice_read`), each into a
staging copy of that shard's layout of which only the needed chunks are filled, in groups
that together stay within `STAGING_BUDGET` (`ros.client.slice_staging`; a read with deltas:
one shard at a time, each shard's staging kept as the next read's base; a reader in a
layout stages one step's part of each source shard at once, and the next step's while that
one arrives when both fit `STAGING_BUDGET`: `ros.client.slice_ahead`); either holds one
staging copy in GPU memory at a time. A reader of slices becomes a holder of its blocks
when it names their layout (`layout=`, `ros.client.layouts`, `ros.client.slice_layout`):
it serves them as a PARTIAL holder from the start, reads them first from the other holders
of the same blocks (pipelined: from one registered before it, as that one reads them),
checked against checksums derived from publisher-verified bytes, reads only what they did
not give from the trainer's shards, in steps of whole blocks (a pipeline per source shard,
the shards read at once, each chunk of its blocks served as soon as its own bytes are in
place: `ros.client.slice_fill`), and then registers as their COMPLETE holder.
Without `layout`, it holds nothing; readers in the publisher's own layout use
`fetch(shard=i)`.

Slices in GPU memory: the staging copy is allocated on their device (when every slice a
source shard fills is on that one device) and filled exactly as a `fetch` into GPU memory
is (`transport.selection` with `device_memory`: same-host CUDA IPC where it can, else TCP
through pinned host buffers), and the intersections are copied device to device
into the slices' own memory. So the peak extra memory is then one source shard *on the
GPU*; a staging copy that does not fit there is put in host memory instead (logged). Host
staging would let an RDMA holder be read (its channel reads into host memory only), but
each intersection would then cost a strided host-side copy and a pageable host-to-device
copy, and a transport into GPU memory could not be used.

This module is the read's entry: it checks the arguments, resolves the version, plans which
part of which source shard each slice takes (`ros.client.slice_plan`), and hands the read to
the layout reader or, pinning the version for the read, to the source shards' reads; what
the read got is a `ros.client.slice_fetch.SliceFetch`.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping, Sequence

from ros.client import layouts
from ros.client.deadline import Deadline
from ros.client.delta_fetch import DeltaReader
from ros.client.fetching import DEFAULT_FETCH_TIMEOUT
from ros.client.identity import Identity
from ros.client.orchestrator import Orchestrator, ProgressCallback
from ros.client.pins import Pins
from ros.client.slice import Slice
from ros.client.slice_fetch import SliceFetch
from ros.client.slice_layout import read_layout
from ros.client.slice_plan import SliceRead
from ros.client.slice_read import read_sources
from tensorhub.errors import DeadlineExceeded, InvalidArgument, TensorHubError
from tensorhub.names import validate_name, validate_version
from transport.pace import DEFAULT_RATE_FLOOR

log = logging.getLogger(__name__)


def fetch_slices(
    runs: Orchestrator,
    pins: Pins,
    me: Identity,
    model: str,
    version: int | str = "latest",
    *,
    slices: Mapping[str, Slice],
    timeout: float = DEFAULT_FETCH_TIMEOUT,
    rate_floor: float = DEFAULT_RATE_FLOOR,
    progress: ProgressCallback | None = None,
    deltas: DeltaReader | None = None,
    layout: str | None = None,
    peers: layouts.LayoutPeers | None = None,
    cover: Sequence[str] = (),
) -> SliceFetch:
    """`Hub.fetch_slices` (its docstring says what a caller gets): plan which chunks of which source
    shard each slice needs, pin the version, run one non-holder `Target` per source shard
    through `runs`, and copy the intersections into place. With `deltas`, each source
    shard's staging copy is kept as the base of the next call, which applies the deltas
    to it. With `layout` (and the client's `peers`), the blocks are read from their
    holders first, then from the block sets of the layouts of `cover` that cover them
    (`ros.client.layout_cover`), only the rest from the source shards, and then served
    (`ros.client.layouts`)."""
    validate_name(model, "model")
    if not slices:
        raise InvalidArgument("fetch_slices needs at least one slice")
    number = 0 if version == "latest" else validate_version(version)
    deadline = Deadline.after(timeout, f"fetch_slices {model}@{version}")
    resolved = runs.resolve(model, number, None, deadline)
    found = int(resolved.version)
    parts = list(resolved.shards) or [resolved.manifest]
    read = SliceRead(
        runs, me, model, found, resolved, parts, slices, deadline, rate_floor, progress
    )
    plan = read.plan(slices)
    result = SliceFetch(found)
    blocks = None
    for other in cover:
        validate_name(other, "layout")
    if cover and layout is None:
        raise InvalidArgument("fetch_slices: `cover` needs the reader's own `layout`")
    if layout is not None:
        validate_name(layout, "layout")
        if peers is None:
            raise InvalidArgument("fetch_slices: a layout is read by its client")
        blocks = layouts.block_set(slices, int(parts[0].chunk_size))
        layouts.check_free(peers, me, model, blocks, found)
    if blocks is not None and peers is not None and layout is not None:
        # Its PARTIAL registration pins the version, in the same transaction, until it
        # registers COMPLETE or releases (`consistency.layouts`): no Pin or Unpin call.
        read_layout(read, peers, layout, cover, blocks, result, deltas)
        return result
    # A reader of slices that is no holder pins the version itself; the pin is its own
    # (not the holder name, whose pin a concurrent fetch of the version may hold).
    pin_id = f"slices-{secrets.token_hex(6)}"
    pins.pin(model, found, pin_id, deadline.work(me.timeout))
    try:
        read_sources(read, plan, result, deltas)
    finally:
        _unpin(pins, me, model, found, pin_id, deadline)
    return result


def _unpin(
    pins: Pins, me: Identity, model: str, version: int, pin_id: str, deadline: Deadline
) -> None:
    """Drop our pin within the deadline; one that does not fit is left to the lease."""
    budget = deadline.finish(me.timeout)
    try:
        if budget is None:
            raise DeadlineExceeded("no time left before the deadline")
        pins.unpin(model, version, pin_id, budget)
    except TensorHubError as exc:
        log.warning(
            "unpin of %s@%d not done (%s): the pin is left to the session's lease "
            "(it goes at close(), or when the lease expires)", model, version, exc,
        )  # fmt: skip
