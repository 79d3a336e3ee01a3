"""The model-parallel workload: ranks publish one shard each of every version, readers
fetch shards of the versions that became visible.

A version of `MP_MODEL` has `ranks` shards, one per `rank` process, each published with
`hub.publish(MP_MODEL, v, tensors, shard=(rank, ranks))`; the hub makes it visible with
the last rank's publish. Like the steps of a trainer, every rank publishes v, then waits
(bounded) for v to become visible before it publishes v + 1, so the ranks publish in
bursts, and the `kill-rank` and `kill-hub` failpoints strike in the middle of one.

A rank's tensors are blocks of the model's global tensors, published with their placements
(`placements`), so that readers in another layout (`chaos.layout_readers`) read their own
blocks across the ranks' shards. They are a function of (model, version, rank)
(`shard_tensors`), so a rank restarted after a kill publishes the same bytes again: it reads
`latest` and publishes the version after it, which is the version in flight when it died. A
publish of unknown outcome is sent again, the same shard with the same bytes (bounded in time
and count): a retried shard publish must be idempotent, and the checker
(`chaos.checker_shards`) reports one that was refused.

A `shard-reader` follows `latest`, inspects each new version (its shard count and one
manifest per shard: it must be whole) and fetches `fetches` of its shards, one at a time,
each from a different rank (the starting shard rotates with the version), serving the last
one fetched until the next fetch. Every operation goes into the history with the content
hash of what was published or fetched, so the checker compares bytes.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import xxhash

import ros
from chaos.history import FAIL, MP_MODEL, OK, error_name, write_outcome
from chaos.worker import Worker, digest, release
from tensorhub.errors import StaleVersion, TensorHubError

SHARD_SHAPES = {"w": 48 * 1024, "b": 1000}  # bytes (uint8) of one rank's tensors
SHARD_CHUNK = 16 * 1024
PUBLISH_TIMEOUT, FETCH_TIMEOUT, INSPECT_TIMEOUT = 10.0, 20.0, 5.0
VISIBLE_WAIT = 20.0  # how long a rank waits for its version to become visible
RETRY_FOR, PUBLISH_TRIES = 20.0, 20  # a shard of unknown outcome is sent again this long
HELD_VERSIONS = 3  # versions a rank keeps serving; older ones are released


def shard_tensors(model: str, version: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors of `model@version`: the same bytes in every incarnation."""
    seed = xxhash.xxh3_64_intdigest(f"{model}/{version}/{rank}".encode()) & (2**63 - 1)
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        for name, n in SHARD_SHAPES.items()
    }


def placements(rank: int, ranks: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Where rank `rank`'s tensors lie in the model's global 1-D tensors of `ranks` times
    their length, (global shape, offsets): readers in another layout read their blocks
    across the ranks' shards by them (`chaos.layout_readers`)."""
    return {name: ((n * ranks,), (n * rank,)) for name, n in SHARD_SHAPES.items()}


def rank(w: Worker) -> None:
    """Publish this rank's shard of version after version, each after the last is visible."""
    hub = w.connect()
    index, count = int(w.spec["index"]), int(w.spec["ranks"])
    held: list[ros.Publication] = []
    version = (w.latest(MP_MODEL) or 0) + 1  # after a restart: the version in flight
    while w.running():
        pub, latest = _publish_shard(w, hub, version, index, count)
        if pub is not None:
            held.append(pub)
            latest = _wait_visible(w, version)
        while len(held) > HELD_VERSIONS:
            release(w, held.pop(0))
        version = max(version, latest) + 1


def _publish_shard(
    w: Worker, hub: ros.Hub, version: int, index: int, count: int
) -> tuple[ros.Publication | None, int]:
    """Publish one shard; one whose outcome is unknown (the hub died mid-call) is sent
    again, as a trainer would, for `RETRY_FOR` seconds and `PUBLISH_TRIES` sends at most, so
    a hub kill does not leave the version without this rank's shard. A definite refusal is
    not sent again: it would be refused again.

    Returns the publication (None if it failed) and the newest version known to be visible
    (`StaleVersion` means `latest` is at `version` or past it).
    """
    tensors = shard_tensors(MP_MODEL, version, index)
    content = digest(tensors)
    give_up = time.monotonic() + RETRY_FOR
    for _ in range(PUBLISH_TRIES):
        if not w.running() or time.monotonic() > give_up:
            break
        op = w.rec.invoke(
            "publish-shard", PUBLISH_TIMEOUT, model=MP_MODEL, version=version, shard=index,
            shards=count, hash=content,
        )  # fmt: skip
        try:
            pub = hub.publish(
                MP_MODEL, version, tensors, chunk_size=SHARD_CHUNK, timeout=PUBLISH_TIMEOUT,
                shard=(index, count), placements=placements(index, count),
            )  # fmt: skip
        except TensorHubError as exc:
            outcome = write_outcome(exc)
            w.rec.complete(op, outcome, error_name(exc))
            if isinstance(exc, StaleVersion):
                return None, max(version, w.latest(MP_MODEL) or 0)
            if outcome == FAIL:
                break
            w.pause(0.2, 0.5)
            continue
        w.rec.complete(op, OK, version=version, revision=pub.revision, visible=pub.visible)
        return pub, version if pub.visible else 0
    return None, 0


def _wait_visible(w: Worker, version: int) -> int:
    """Poll `latest` until `version` is visible (or passed), at most `VISIBLE_WAIT` seconds;
    returns the last `latest` seen. A version whose rank died may never become visible."""
    deadline = time.monotonic() + VISIBLE_WAIT
    seen = 0
    while w.running() and time.monotonic() < deadline:
        seen = max(seen, w.latest(MP_MODEL) or 0)
        if seen >= version:
            break
        w.pause(0.2, 0.4)
    return seen


def shard_reader(w: Worker) -> None:
    """Inspect every new visible version and fetch some of its shards, checked by hash."""
    hub = w.connect()
    count, fetches = int(w.spec["ranks"]), int(w.spec.get("fetches", 4))
    offset = int(w.spec["offset"])  # readers start apart: together they read more shards
    held: ros.Held | None = None
    for version in w.new_versions(MP_MODEL):
        _inspect(w, hub, version)
        for j in range(min(fetches, count)):
            if not w.running():
                break
            if held is not None:  # one shard of a version per client: release it first
                release(w, held)
                held = None
            held = _fetch_shard(w, hub, version, (offset + version + j) % count)
    if held is not None:
        release(w, held)


def _inspect(w: Worker, hub: ros.Hub, version: int) -> None:
    """Record what the hub says a visible version is made of: its shard count and the
    manifests it answers (one per shard, or the version is not whole)."""

    def read() -> dict[str, Any]:
        info = hub.inspect(MP_MODEL, version, timeout=INSPECT_TIMEOUT)
        return {
            "version": int(info.version), "shard_count": int(info.shard_count),
            "manifests": len(info.shards), "revision": int(info.revision),
        }  # fmt: skip

    w.call("inspect-shards", INSPECT_TIMEOUT, read, model=MP_MODEL, version=version)


def _fetch_shard(w: Worker, hub: ros.Hub, version: int, shard: int) -> ros.Held | None:
    op = w.rec.invoke("fetch-shard", FETCH_TIMEOUT, model=MP_MODEL, version=version, shard=shard)
    try:
        got = hub.fetch(MP_MODEL, version, shard=shard, timeout=FETCH_TIMEOUT)
    except TensorHubError as exc:
        w.rec.complete(op, FAIL, error_name(exc))
        return None
    w.rec.complete(op, OK, version=got.version, shard=got.shard, hash=digest(got.tensors))
    return got
