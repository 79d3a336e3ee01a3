"""One encoded trainer chunk's changes, XORed into a layout reader's blocks in place: the
apply step of `ros.client.layout_delta` (its check, decode and scatter), apart from the plan
and the reads around it."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

import numpy as np
import torch

from ros.client.layouts import BlockSet
from ros.client.slice import Slice
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.delta_rules import PLANES
from tensorhub.errors import IntegrityError
from transport import delta as codec
from transport import delta_words
from transport.boxes import Box
from transport.layout import Layout, TensorSpec, torch_dtype

log = logging.getLogger(__name__)


class Part(Protocol):
    """One source shard's part of a block (`ros.client.slice_plan.Copy`)."""

    @property
    def name(self) -> str: ...

    @property
    def source(self) -> Box: ...  # the block the source shard holds

    @property
    def part(self) -> Box: ...  # the intersection the reader takes


def apply_chunk(
    blob: memoryview,
    section: pb.Delta,
    layout: Layout,
    k: int,
    copies: Mapping[str, Part],
    slices: Mapping[str, Slice],
    blocks: BlockSet,
) -> bool:
    """Check trainer chunk `k`'s encoding against v's manifest, decode it, and XOR the
    changed bytes that lie in `copies`' blocks into them; False (logged) if it failed a
    check or its decoding raised (nothing of it written then: it is decoded whole first)."""
    try:
        if codec.digest(blob) != section.encoded_xxh3[k]:
            raise IntegrityError(f"encoded chunk {k}: digest")
        at, values = changes(blob, section.encoding, layout.payload_bytes(k))
    except Exception as exc:  # a hostile or torn encoding fails its chunk alone
        log.warning("layout delta: trainer chunk %d: %s; its blocks are read whole", k, exc)
        return False
    start = 0
    for seg in layout.segments(k):
        lo, hi = np.searchsorted(at, [start, start + seg.length]).tolist()
        spec = layout.tensors[seg.tensor]
        c = copies.get(spec.name)
        if c is not None and hi > lo:
            offsets = at[lo:hi] - start + seg.start
            _xor_into(offsets, values[lo:hi], spec, c, slices[c.name], blocks.tensors[c.name])
        start += seg.length
    return True


def changes(blob: memoryview, encoding: str, payload: int) -> tuple[np.ndarray, np.ndarray]:
    """The bytes a chunk's encoding changes: their positions in the chunk's payload
    (int64, increasing) and their XOR (uint8, not zero). The changed-words form is decoded
    as it is; the byte-planes form through a zeroed chunk (one chunk's payload)."""
    if encoding != PLANES and bytes(blob[:1]) == codec.WORDS and payload % 2 == 0:
        words_at, words = delta_words.decode(blob[1:], payload // 2)
        at = np.stack([2 * words_at, 2 * words_at + 1], axis=1).reshape(-1)
        values = words.view(np.uint8).reshape(-1)  # each word's bytes, as in memory
    else:
        xor = torch.zeros(payload, dtype=torch.uint8)
        codec.apply([xor], blob, encoding)
        flat = xor.numpy()
        at = flat.nonzero()[0].astype(np.int64)
        values = flat[at]
    keep = values != 0
    return at[keep], values[keep]


def _xor_into(
    offsets: np.ndarray,
    values: np.ndarray,
    spec: TensorSpec,
    c: Part,
    want: Slice,
    block: torch.Tensor,
) -> None:
    """XOR `values` into the bytes at `offsets` of the source shard's tensor `spec` (which
    holds `c.source`) where they fall inside the reader's block `c.part`, at their place in
    `block` (the reader's memory for `want.box`, contiguous, in place on its device)."""
    itemsize = torch_dtype(spec.dtype).itemsize
    element, within = np.divmod(offsets, itemsize)
    inside = np.ones(element.shape, dtype=bool)
    local: list[np.ndarray] = []
    if c.source.shape:
        coords = np.unravel_index(element, c.source.shape)
        for d, coord in enumerate(coords):
            g = coord + c.source.offsets[d]
            inside &= (g >= c.part.offsets[d]) & (g < c.part.offsets[d] + c.part.shape[d])
            local.append(g - want.box.offsets[d])
    if not inside.any():
        return
    if local:
        flat = np.ravel_multi_index(tuple(x[inside] for x in local), want.box.shape)
    else:
        flat = np.zeros(int(inside.sum()), dtype=np.int64)
    at = flat.astype(np.int64) * itemsize + within[inside]
    data = block.reshape(-1).view(torch.uint8)
    if data.device.type == "cpu":
        array = data.numpy()
        array[at] ^= values[inside]
    else:
        where = torch.from_numpy(at).to(data.device)
        xor = torch.from_numpy(np.ascontiguousarray(values[inside])).to(data.device)
        data[where] = data[where] ^ xor
