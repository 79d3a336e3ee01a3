"""Publish-time checksums of declared layouts (docs/design-notes.md, "Publish-time checksums
of declared layouts"): the rollout's side declares its block sets (`rows_of`), the
publisher's side computes, for each declared block set, the wsum64 of every chunk of the
block set's layout from the bytes it publishes (`layout_sums`).

A block set's layout is the one its readers serve (`ros.client.layouts.block_set`: each
block one tensor, sorted by name, in the publisher's chunk size), and its id the digest of
the same description, so the sums a publisher computes are the ones a reader of those
blocks looks up. `wsum64` is linear in the bytes, so a publisher that holds only some of a
chunk's bytes could add its part (the others zero) and the parts would add up; a whole
publish holds them all.

`DeclaredCache` keeps, per model, the declarations this client last read and their
revision: a publish names that revision, and the hub refuses it (`LayoutsChanged`, nothing
written) if the declarations moved since; the publisher then reads them again and computes
again. A client that never saw a declaration names revision 0 (none), so a model with none
costs no extra call.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from itertools import pairwise

import torch

from ros.client.layouts import describe, digest_of
from ros.client.manifest import placement_of
from ros.client.slice import Slice
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.declared_records import MAX_PARTS_BYTES, MAX_PUBLISHER_SUMS, Part, encode_parts
from tensorhub.errors import InvalidArgument
from transport.boxes import Box
from transport.checksums import wsum64_of_rows, wsum64_of_segments
from transport.layout import Layout, dtype_name, torch_dtype

log = logging.getLogger(__name__)


def rows_of(slices: Mapping[str, Slice]) -> bytes:
    """One worker's blocks as declared: JSON rows [name, dtype, global shape, offsets,
    shape], sorted by name (the description `ros.client.layouts.describe` makes, less the
    chunk size, which is the publisher's)."""
    rows = [
        [name, dtype_name(want.tensor.dtype), [int(d) for d in want.global_shape],
         list(want.box.offsets), list(want.box.shape)]
        for name, want in sorted(slices.items())
    ]  # fmt: skip
    return json.dumps(rows, separators=(",", ":")).encode()


Blocks = dict[str, tuple[str, tuple[int, ...], Box]]
"""A declared block set: per tensor name, its dtype's name, its global shape and its box."""


def _parse(raw: bytes) -> Blocks:
    """A declared block set's JSON rows [name, dtype, global shape, offsets, shape]."""
    return {
        str(name): (str(dtype), tuple(int(d) for d in glob),
                    Box(tuple(int(o) for o in offsets), tuple(int(n) for n in shape)))
        for name, dtype, glob, offsets, shape in json.loads(raw)
    }  # fmt: skip


def _blocks(raw: bytes, tensors: Mapping[str, torch.Tensor]) -> Blocks | None:
    """The declared blocks of one block set, if the published `tensors` (whole) hold every
    one of them with its dtype and global shape; else None."""
    blocks = _parse(raw)
    for name, (dtype, glob, _) in blocks.items():
        tensor = tensors.get(name)
        if tensor is None or dtype_name(tensor.dtype) != dtype or tuple(tensor.shape) != glob:
            return None
    return blocks


GROUP_BYTES = 4 * 1024 * 1024
"""Bytes of a block set's layout summed in one pass in host memory (whole chunks, at least
one): the publisher's extra memory is one such buffer and one block's contiguous copy. Small
enough to stay in the CPU's cache between the copy and the sum: with the bench reshard
model (70 MiB of blocks, 64 KiB chunks) 4 MiB took 56 ms at best where 64 MiB took 172 ms
(2 cores, loaded)."""

DEVICE_GROUP_BYTES = 256 * 1024 * 1024
"""The same in GPU memory, where each pass is a few kernel launches and one copy of the
group's sums to the host: larger groups, fewer launches and waits."""


def _specs(
    blocks: Mapping[str, tuple[str, tuple[int, ...], Box]], tensors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Each block as a tensor without memory (its dtype and shape), sorted by name."""
    return {
        name: torch.empty(box.shape, dtype=tensors[name].dtype, device="meta")
        for name, (_, _, box) in sorted(blocks.items())
    }


def block_set_sums(
    blocks: Mapping[str, tuple[str, tuple[int, ...], Box]],
    tensors: Mapping[str, torch.Tensor],
    chunk_size: int,
) -> tuple[str, list[int]]:
    """(id, the wsum64 of every chunk) of the block set `blocks` of the whole `tensors`, in
    chunks of `chunk_size`, computed where the tensors are. When the block set's layout has
    no padding between its tensors (each block's bytes a multiple of `ALIGN`, as a model's
    almost always are), a chunk's bytes are one range of the layout: the blocks are copied
    into a buffer of whole chunks, `GROUP_BYTES` at a time, and each group's chunks summed
    in one multiply and one reduction. Else each chunk is summed over its segments."""
    specs = _specs(blocks, tensors)
    layout = Layout.from_tensors(specs, chunk_size=chunk_size)
    block_set = digest_of(describe(blocks, chunk_size))

    def view(name: str) -> torch.Tensor:
        glob = blocks[name][1]
        return tensors[name][blocks[name][2].slices_in(Box((0,) * len(glob), glob))]

    gapless = all(a.offset + a.nbytes == b.offset for a, b in pairwise(layout.tensors))
    if not gapless:
        copies = {spec.name: view(spec.name).contiguous() for spec in layout.tensors}
        flats = [copies[spec.name].reshape(-1).view(torch.uint8) for spec in layout.tensors]
        return block_set, [
            wsum64_of_segments(flats, layout.segments(i)) for i in range(layout.num_chunks)
        ]
    device = next(iter(tensors.values())).device
    per = max(1, (GROUP_BYTES if device.type == "cpu" else DEVICE_GROUP_BYTES) // chunk_size)
    sums: list[int] = []
    cached: tuple[str, torch.Tensor] | None = None
    whole = torch.empty(min(per, layout.num_chunks) * chunk_size, dtype=torch.uint8, device=device)
    for first in range(0, layout.num_chunks, per):
        count = min(per, layout.num_chunks - first)
        lo, hi = first * chunk_size, (first + count) * chunk_size
        buf = whole[: count * chunk_size]  # one buffer for every group: its pages once
        end = min(hi, layout.total_bytes)
        buf[end - lo :].zero_()  # the last chunk's tail: zeros, as wsum64 pads
        for spec in layout.tensors:
            a, b = max(lo, spec.offset), min(hi, spec.offset + spec.nbytes)
            if a >= b:
                continue
            if (a, b) == (spec.offset, spec.offset + spec.nbytes):  # whole: one strided copy
                dest = buf[a - lo : b - lo].view(specs[spec.name].dtype)
                dest.view(specs[spec.name].shape).copy_(view(spec.name))
                continue
            if cached is None or cached[0] != spec.name:  # split by a group's edge
                cached = (spec.name, view(spec.name).contiguous().reshape(-1).view(torch.uint8))
            buf[a - lo : b - lo] = cached[1][a - spec.offset : b - spec.offset]
        sums.extend(wsum64_of_rows(buf, chunk_size))  # the buffer is ours, read no more
    return block_set, sums


def layout_sums(
    declared: Mapping[str, Sequence[bytes]],
    tensors: Mapping[str, torch.Tensor],
    chunk_size: int,
) -> list[pb.LayoutSums]:
    """The checksums of every declared block set the whole `tensors` hold, in chunks of
    `chunk_size`; a block set they do not hold (another model's names, dtypes or shapes)
    is skipped (logged): its readers take the reader-derived path. None at all past
    `MAX_PUBLISHER_SUMS` (logged)."""
    planned: list[tuple[str, Blocks]] = []
    total = 0
    for layout, sets in sorted(declared.items()):
        for raw in sets:
            blocks = _blocks(raw, tensors)
            if blocks is None:
                log.warning("declared layout %r: a block set this publish does not hold", layout)
                continue
            total += Layout.from_tensors(_specs(blocks, tensors), chunk_size).num_chunks
            if total > MAX_PUBLISHER_SUMS:  # counted before any byte is summed
                log.warning("over %d publisher checksums: none sent", MAX_PUBLISHER_SUMS)
                return []
            planned.append((layout, blocks))
    out = []
    for layout, blocks in planned:
        block_set, sums = block_set_sums(blocks, tensors, chunk_size)
        out.append(pb.LayoutSums(layout=layout, block_set=block_set, sums=sums))
    return out


def layout_parts(
    declared: Mapping[str, Sequence[bytes]],
    tensors: Mapping[str, torch.Tensor],
    manifest: pb.Manifest,
    chunk_size: int,
) -> list[pb.LayoutPart] | None:
    """A shard's parts of the checksums of every declared block set (`LayoutPart`): for
    each block of a block set whose tensor this rank holds a box of (its manifest's
    placement, or the whole tensor), the wsum64 of each chunk the block touches with only
    the bytes of that box in place and every other byte zero. The parts of the ranks add up
    to the chunks' sums (`wsum64` is linear; a word that straddles two ranks' bytes splits
    by byte), parts of replicas (the same box) counting once. A block set whose layout has
    padding between its blocks gets none (the same on every rank: it depends only on the
    declaration). None (logged), so that the shard sends no parts at all and the version
    records no sums (`tensorhub.declared_records.add_parts` needs every shard's): a
    declared block whose dtype or global shape is not the published one, or more than
    `MAX_PUBLISHER_SUMS` sums in all, or parts that would take over `MAX_PARTS_BYTES` as
    the hub writes them."""
    held = {entry.name: placement_of(entry) for entry in manifest.tensors}
    out: list[pb.LayoutPart] = []
    total = 0
    for layout_name, sets in sorted(declared.items()):
        for raw in sets:
            blocks = _parse(raw)
            for name, (dtype, glob, _) in blocks.items():
                tensor = tensors.get(name)
                if tensor is not None and (
                    dtype_name(tensor.dtype) != dtype or held[name][0] != glob
                ):
                    log.warning(
                        "declared layout %r: block %r is not as published", layout_name, name
                    )
                    return None
            specs = {
                name: torch.empty(box.shape, dtype=torch_dtype(dtype), device="meta")
                for name, (dtype, _, box) in sorted(blocks.items())
            }
            layout = Layout.from_tensors(specs, chunk_size=chunk_size)
            if any(a.offset + a.nbytes != b.offset for a, b in pairwise(layout.tensors)):
                continue  # padding between blocks: no parts, on any rank
            block_set = digest_of(describe(blocks, chunk_size))
            for spec in layout.tensors:
                if spec.name not in tensors:
                    continue
                glob, box = held[spec.name]
                part = _part(spec.offset, spec.nbytes, specs[spec.name], blocks[spec.name][2],
                             box, tensors[spec.name], chunk_size)  # fmt: skip
                if part is None:
                    continue
                chunks, sums = part
                total += len(sums)
                if total > MAX_PUBLISHER_SUMS:
                    log.warning("over %d publisher checksums: none sent", MAX_PUBLISHER_SUMS)
                    return None
                out.append(pb.LayoutPart(
                    layout=layout_name, block_set=block_set, tensor=spec.name,
                    offsets=list(box.offsets), shape=list(box.shape), chunks=chunks, sums=sums,
                ))  # fmt: skip
    as_written = [
        Part(p.layout, p.block_set, p.tensor, (tuple(p.offsets), tuple(p.shape)),
             tuple(p.chunks), tuple(p.sums))
        for p in out
    ]  # fmt: skip
    if len(encode_parts(0, 0, as_written)) + 64 > MAX_PARTS_BYTES:  # 64: revision, count
        log.warning("parts of publisher checksums over %d bytes: none sent", MAX_PARTS_BYTES)
        return None
    return out


def _part(
    offset: int,
    nbytes: int,
    spec: torch.Tensor,
    block: Box,
    box: Box,
    tensor: torch.Tensor,
    chunk_size: int,
) -> tuple[list[int], list[int]] | None:
    """(chunks, sums) of one block at `offset` in a gapless block set layout, with only the
    elements of the rank's `box` (held as `tensor`) in place: None if they do not meet."""
    common = block.intersect(box)
    if common is None or common.volume == 0:
        return None
    first, last = offset // chunk_size, (offset + nbytes - 1) // chunk_size
    buf = torch.zeros((last - first + 1) * chunk_size, dtype=torch.uint8, device=tensor.device)
    start = offset - first * chunk_size
    region = buf[start : start + nbytes].view(spec.dtype).view(spec.shape)
    region[common.slices_in(block)].copy_(tensor[common.slices_in(box)])
    return list(range(first, last + 1)), wsum64_of_rows(buf, chunk_size)


class DeclaredCache:
    """Per model, the declared layouts this client last read and their revision (0: none
    seen). Thread-safe."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[int, dict[str, list[bytes]]]] = {}
        self._read: dict[str, float] = {}
        self._lock = threading.Lock()

    def get(self, model: str) -> tuple[int, dict[str, list[bytes]]]:
        with self._lock:
            return self._known.get(model, (0, {}))

    def put(self, model: str, answer: pb.DeclaredLayoutsResponse) -> None:
        layouts = {d.layout: list(d.block_sets) for d in answer.layouts}
        with self._lock:
            self._known[model] = (int(answer.revision), layouts)
            self._read[model] = time.monotonic()

    def age(self, model: str) -> float:
        """Seconds since the declarations of `model` were last read (inf: never)."""
        with self._lock:
            read = self._read.get(model)
        return float("inf") if read is None else time.monotonic() - read


def check_declaration(
    model: str, layout: str, workers: Sequence[Mapping[str, Slice]]
) -> list[bytes]:
    """The declared rows of each worker's slices (`InvalidArgument` for none)."""
    if not workers or any(not slices for slices in workers):
        raise InvalidArgument(
            f"declare_layout {model} {layout!r}: name each worker's slices (at least one)"
        )
    return [rows_of(slices) for slices in workers]
