"""Readers of the model-parallel model in a second layout (`layout-reader`): rollouts whose
blocks cut across the ranks' shards, holders of their blocks (`Hub.fetch_slices(layout=)`).

The ranks (`chaos.shards`) publish their tensors as blocks of global 1-D tensors: rank r's
`w` is `[r * W, (r + 1) * W)` of a global `w` of `ranks * W` elements (likewise `b`), said
by its placements (`chaos.shards.placements`). The second layout, `LAYOUT`, has
`block_sets(ranks)` block sets; set s takes, of each global tensor, the span of one rank's
length that starts in the middle of rank s's shard: the second half of rank s's tensor and
the first half of rank s + 1's (with one rank: the second half of its tensor). So every
block is a reshard: it spans two shards, starts and ends mid-chunk.

A layout reader follows `latest` of `MP_MODEL` and, for each new version, fetches one block
set with `fetch_slices(layout=LAYOUT)` into fresh memory, then releases the blocks it held
(`release_blocks`): it serves each version's blocks until its next fetch. Readers 2k and
2k + 1 take the same set of a version (the set rotates with the version), and the second
starts a moment later, so it can read from the first. Each fetch goes into the history with
its set, the content hash of every block and the bytes read per source holder (and the
holders it dropped); the checker (`chaos.checker_layouts`) recomputes every block from the
ranks' deterministic tensors (`shard_tensors`).
"""

from __future__ import annotations

from typing import Any

import torch

import ros
from chaos.history import FAIL, INFO, MP_MODEL, OK, error_name
from chaos.shards import SHARD_SHAPES, shard_tensors
from chaos.worker import Worker, digest
from tensorhub.errors import TensorHubError

LAYOUT = "chaos-l2"
FETCH_TIMEOUT, RELEASE_TIMEOUT = 20.0, 10.0
SECOND_WAIT = (0.1, 0.3)  # the second reader of a pair lets the first fetch (and serve) first


def block_sets(ranks: int) -> int:
    """How many block sets the second layout has (each spans two ranks' shards)."""
    return max(1, ranks - 1)


def block_boxes(ranks: int, block_set: int) -> dict[str, tuple[int, int]]:
    """(start, length) of each global tensor's block in block set `block_set`."""
    if not 0 <= block_set < block_sets(ranks):
        raise ValueError(f"block set {block_set} of {block_sets(ranks)}")
    out = {}
    for name, n in SHARD_SHAPES.items():
        start = block_set * n + n // 2
        out[name] = (start, min(n, n * ranks - start))
    return out


def expected_blocks(
    model: str, version: int, ranks: int, block_set: int
) -> dict[str, torch.Tensor]:
    """The blocks of set `block_set` of `model@version` as the ranks' tensors make them:
    cut from the concatenation of every rank's tensor, computed anew (`shard_tensors`)."""
    boxes = block_boxes(ranks, block_set)
    out = {}
    for name, (start, length) in boxes.items():
        n = SHARD_SHAPES[name]
        first, last = start // n, (start + length - 1) // n
        whole = torch.cat([shard_tensors(model, version, r)[name] for r in range(first, last + 1)])
        out[name] = whole[start - first * n : start - first * n + length].clone()
    return out


def block_hashes(blocks: dict[str, torch.Tensor]) -> dict[str, str]:
    """The content hash of each block on its own (name and bytes, as `digest`)."""
    return {name: digest({name: tensor}) for name, tensor in blocks.items()}


def layout_reader(w: Worker) -> None:
    """Fetch one block set of every new visible version in the second layout and serve it
    until the next fetch."""
    hub = w.connect()
    ranks = int(w.spec["ranks"])
    index = int(w.spec["index"])
    pair = index // 2  # readers 2k and 2k + 1 take the same blocks
    held = 0  # the version whose blocks this reader serves (0: none)
    for version in w.new_versions(MP_MODEL):
        if index % 2:
            w.pause(*SECOND_WAIT)
        fetched = _fetch_blocks(w, hub, version, ranks, (version + pair) % block_sets(ranks))
        if held:
            _release(w, hub, held)
            held = 0
        if fetched:
            held = version
    if held:
        _release(w, hub, held)


def _fetch_blocks(w: Worker, hub: ros.Hub, version: int, ranks: int, block_set: int) -> bool:
    """Fetch block set `block_set` of `version` in `LAYOUT` into fresh memory (served from
    it); whether the fetch succeeded."""
    boxes = block_boxes(ranks, block_set)
    out = {name: torch.empty(length, dtype=torch.uint8) for name, (_, length) in boxes.items()}
    slices = {
        name: ros.Slice(out[name], (start,), (SHARD_SHAPES[name] * ranks,))
        for name, (start, _) in boxes.items()
    }
    op = w.rec.invoke(
        "fetch-layout", FETCH_TIMEOUT, model=MP_MODEL, version=version, layout=LAYOUT,
        ranks=ranks, set=block_set,
    )  # fmt: skip
    try:
        got = hub.fetch_slices(
            MP_MODEL, version, slices=slices, layout=LAYOUT, timeout=FETCH_TIMEOUT
        )
    except TensorHubError as exc:
        w.rec.complete(op, FAIL, error_name(exc))
        return False
    value: dict[str, Any] = {
        "version": got.version, "hashes": block_hashes(out), "served": got.served,
        "sources": dict(got.bytes_per_source), "from_trainer": sorted(got.from_trainer),
        "failed_sources": sorted(got.failed_sources),
    }  # fmt: skip
    w.rec.complete(op, OK, **value)
    return True


def _release(w: Worker, hub: ros.Hub, version: int) -> None:
    op = w.rec.invoke(
        "release-blocks", RELEASE_TIMEOUT, model=MP_MODEL, version=version, layout=LAYOUT
    )
    try:
        held = hub.release_blocks(MP_MODEL, version, timeout=RELEASE_TIMEOUT)
    except TensorHubError as exc:
        w.rec.complete(op, INFO, error_name(exc))
        return
    w.rec.complete(op, OK, held=held)
