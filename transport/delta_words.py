"""The changed-words form of a chunk's delta: where the chunk's 2-byte words changed, and
their XOR with the base, instead of the XOR of every word.

An RL step at a small learning rate changes 1-3 % of a model's bf16 words. Byte planes of
the full XOR (`transport.delta`'s dense form) compress well, but applying them decodes and
XORs every byte of the chunk; this form lists only the words that changed, so applying it
touches only those (2-3x less CPU per step here), and it is also smaller at such
densities (the positions compress better than the runs of zero bytes between them:
docs/design-notes.md, "Delta versions").

Format, after the one-byte kind: the chunk's number of words and the count c of changed
words (each a uint32, little-endian; a chunk is at most 1 GiB), then a zstd frame of 6c
bytes:

    the c gaps as int32 little-endian, in 4 byte planes (every first byte, then every
    second, ...), then the c XOR words as their 2 raw bytes, in 2 byte planes;

word k changed is at word position (gap_0 + ... + gap_k) - 1 (so every gap is >= 1 and
positions strictly increase). The work on the tensors' device is the XOR, the search for
changed words and the scatter; the small gap and value arrays are built and read on the
host (numpy: per-chunk overhead matters more than bandwidth for arrays this small).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from tensorhub.errors import DeltaRefused, IntegrityError
from transport import zstd_contexts

MAX_SHARE = 0.125  # more changed words than this share of a chunk's: the dense form
# the most a reader decodes: the share the first publishers of this form used (a quarter),
# so a frame lists at most 6 x words / 4 bytes, 3/4 of the chunk, whatever it declares
READ_SHARE = 0.25


def changed(old: torch.Tensor, new: torch.Tensor) -> tuple[np.ndarray, np.ndarray] | None:
    """The positions (int64) of the 2-byte words where chunk payloads `old` and `new` (an
    even number of bytes each, on one device) differ, and their XOR ((c, 2) uint8), both
    on the host; None when more than `MAX_SHARE` of the words differ."""
    words = new.numel() // 2
    limit = int(MAX_SHARE * words)
    if new.device.type != "cpu":
        w = torch.bitwise_xor(old, new).view(torch.int16)
        if int(torch.count_nonzero(w)) > limit:
            return None
        idx = torch.nonzero(w).reshape(-1)
        return idx.cpu().numpy(), w[idx].cpu().numpy().view(np.uint8).reshape(-1, 2)
    a, b = old.numpy(), new.numpy()
    a16, b16 = a.view(np.uint16), b.view(np.uint16)
    if a.size % 8 == 0:  # 8-byte blocks first: 4x fewer elements to compare and scan
        a64, b64 = a.view(np.uint64), b.view(np.uint64)
        differ = a64 != b64
        # blocks that differ: from a quarter of the words that differ to all of them, so
        # a dense chunk is known before any word is listed (counted exactly only when the
        # blocks cannot tell)
        count = np.count_nonzero(differ)
        if count > limit or (4 * count > limit and np.count_nonzero(a16 != b16) > limit):
            return None
        blocks = differ.nonzero()[0]
        # the XOR of the blocks that differ, gathered as whole 8-byte blocks (a gather of
        # 4-word rows costs twice as much), then its words that are not zero
        quads = (a64[blocks] ^ b64[blocks]).view(np.uint16)
        at = quads.nonzero()[0]
        idx, values = blocks[at >> 2] * 4 + (at & 3), quads[at]
    else:
        idx = (a16 != b16).nonzero()[0]
        values = a16[idx] ^ b16[idx]
    if idx.size > limit:
        return None
    return idx, values.view(np.uint8).reshape(-1, 2)


def encode(words: int, idx: np.ndarray, values: np.ndarray, level: int) -> bytes:
    """`changed`'s result for a chunk of `words` words, in the format (module docstring)."""
    count = int(idx.size)
    gaps = np.empty(count, dtype="<i4")
    if count:
        gaps[0] = idx[0] + 1
        np.subtract(idx[1:], idx[:-1], out=gaps[1:], casting="unsafe")
    body = np.concatenate([
        gaps.view(np.uint8).reshape(-1, 4).T.reshape(-1),
        values.reshape(-1, 2).T.reshape(-1),
    ])  # fmt: skip
    head = words.to_bytes(4, "little") + count.to_bytes(4, "little")
    return head + zstd_contexts.compressor(level).compress(body.data)


Decoded = tuple[np.ndarray, np.ndarray]  # a chunk's positions and XOR words, as `decode`'s
# frames decoded at once from this many up (`decode_many`): below it, the dozen calls for
# them all cost more than a dozen each (at 1.3 % of a 256 KiB chunk's words changed, 96
# frames: 4.7 ms in ones, 3.3 in twos, 3.1 in threes, 2.3 in eights, against 3.0 alone)
JOINT = 3


def decode(encoded: bytes | memoryview, words: int) -> Decoded:
    """The positions (int64, each below `words`, strictly increasing) and the XOR words
    ((c,) uint16, raw byte order) of an encoding of a chunk of `words` words;
    `IntegrityError` for anything else (`DeltaRefused`, before decoding, for a frame that
    does not declare the 6c bytes its count c says, or more than `READ_SHARE` of the
    words)."""
    count, raw = _frame(encoded, words)
    return _decoded(count, raw, words)


def _decoded(count: int, raw: bytes, words: int) -> Decoded:
    """The positions and words of a frame decoded (`_frame`: `count` words, `raw` its 6c
    bytes) of a chunk of `words` words; `IntegrityError` unless they are in it and in order."""
    body = np.frombuffer(raw, dtype=np.uint8)
    positions = _positions(body[: 4 * count], count)
    if count and int(positions[-1]) >= words:
        raise IntegrityError(f"changed-words delta chunk: a position past word {words}")
    return positions, _words(body[4 * count :], count)


def _frame(encoded: bytes | memoryview, words: int) -> tuple[int, bytes]:
    """The count c of changed words an encoding of a chunk of `words` words states, and its
    frame decoded (6c bytes): its header's checks and the frame's (`decode`)."""
    view = memoryview(encoded)
    if len(view) < 8:
        raise IntegrityError("changed-words delta chunk: no header")
    total = int.from_bytes(view[:4], "little")
    count = int.from_bytes(view[4:8], "little")
    if total != words:
        raise IntegrityError(f"changed-words delta of a chunk of {total} words, not {words}")
    if count > READ_SHARE * words:
        raise DeltaRefused(f"changed-words delta chunk: {count} words of {words}")
    raw = zstd_contexts.decompress_exact(view[8:], 6 * count, "changed-words delta chunk")
    return count, raw


def decode_many(
    encoded: Sequence[bytes | memoryview], words: Sequence[int]
) -> list[Decoded | IntegrityError]:
    """`decode` of each encoding (of a chunk of `words[k]` words), or the `IntegrityError`
    (`DeltaRefused`) it raises for that one: the same checks, with the frames' gaps and
    words turned into positions and words for all of them at once. A reader decodes
    hundreds of chunks of a few thousand changed words a step, where numpy's fixed cost
    per call (a dozen calls a chunk) weighs as much as the work; here each chunk costs its
    frame's decode and a few slices, and the rest is a dozen calls for them all (each
    chunk's arrays are views of the joined ones; fewer than `JOINT` frames are decoded
    each alone). A frame the joint checks refuse is decoded again alone, whose error is
    the one given: both ways refuse the same chunks."""
    refused: dict[int, IntegrityError] = {}  # by position in `encoded`
    found: list[tuple[int, int, bytes]] = []  # (k, count, frame decoded) of those read
    for k, (enc, n) in enumerate(zip(encoded, words, strict=True)):
        try:
            count, raw = _frame(enc, n)
        except IntegrityError as exc:  # DeltaRefused is one
            refused[k] = exc
            continue
        found.append((k, count, raw))
    if len(found) < JOINT:
        decoded = [_alone(count, raw, words[k]) for k, count, raw in found]
    else:
        joints = _decode_bodies(found, words)
        decoded = [
            joint if joint is not None else _alone(count, raw, words[k])
            for (k, count, raw), joint in zip(found, joints, strict=True)
        ]
    read = iter(decoded)  # in the order of `found`: the encodings not refused
    return [refused[k] if k in refused else next(read) for k in range(len(encoded))]


def _alone(count: int, raw: bytes, words: int) -> Decoded | IntegrityError:
    """`decode`'s result for one frame decoded (`_frame`), or the error it raises (for a
    frame the joint checks refused: this says why)."""
    try:
        return _decoded(count, raw, words)
    except IntegrityError as exc:
        return exc


def _decode_bodies(
    found: list[tuple[int, int, bytes]], words: Sequence[int]
) -> list[Decoded | None]:
    """The positions and words of each decoded frame in `found` ((k, count c, its 6c
    bytes)), in order, or None for one whose gaps are not all at least 1 or whose last
    position is not below its chunk's `words[k]`: `decode`'s checks, on all the frames'
    planes joined
    (a little-endian host; elsewhere each frame is decoded alone)."""
    counts = np.array([count for _, count, _ in found], dtype=np.int64)
    total = int(counts.sum())
    if not _LITTLE or not total:
        none = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.uint16)
        return [None if count else none for _, count, _ in found]
    # a frame of c words is 6 planes of c bytes: row p of `planes` is plane p of them all
    planes = np.concatenate(
        [np.frombuffer(raw, dtype=np.uint8).reshape(6, count) for _, count, raw in found],
        axis=1,
    )
    if not np.count_nonzero(planes[3]):  # every gap under 2**24: int64 from 3 planes
        items = np.zeros((total, 8), dtype=np.uint8)
        for p in range(3):
            items[:, p] = planes[p]
        gaps = items.reshape(-1).view(np.int64)
    else:
        items = np.empty((total, 4), dtype=np.uint8)
        for p in range(4):
            items[:, p] = planes[p]
        gaps = items.reshape(-1).view("<i4").astype(np.int64)
    ends = np.cumsum(counts)
    refused: set[int] = set()
    if int(gaps.min()) < 1:
        refused.update(np.searchsorted(ends, (gaps < 1).nonzero()[0], side="right").tolist())
    # word i of a frame is at its gaps' sum up to i, less 1: one running sum over all the
    # frames, each frame's first gap less the sum of the frame before it (and the very
    # first less 1), so that the sum starts again at each frame
    sized = (counts > 0).nonzero()[0]
    firsts = ends[sized] - counts[sized]
    sums = np.add.reduceat(gaps, firsts)
    gaps[firsts[0]] -= 1
    gaps[firsts[1:]] -= sums[:-1]
    positions = torch.from_numpy(gaps)
    torch.cumsum(positions, 0, out=positions)  # in place (numpy would copy)
    limits = np.array(words, dtype=np.int64)[[k for k, _, _ in found]]
    past = sized[gaps[ends[sized] - 1] >= limits[sized]]
    refused.update(past.tolist())
    values = planes[5].astype(np.uint16)
    values <<= 8
    values |= planes[4]
    out: list[Decoded | None] = []
    start = 0
    for j, (_, count, _) in enumerate(found):
        end = start + count
        out.append(None if j in refused else (gaps[start:end], values[start:end]))
        start = end
    return out


def _words(planes: np.ndarray, count: int) -> np.ndarray:
    """The `count` 2-byte words (uint16, raw byte order) whose first and second bytes are
    the two planes of `planes`. On a little-endian host, the second plane widened, shifted
    and ORed with the first: three vectorized passes, 1.0-1.1 ms for a `bench delta` step's
    0.85-1.5 M words decoded alone here (1.6-1.8 ms within a whole apply), against 1.1-1.6
    (1.9-2.1) ms to write the two planes into the columns of a (count, 2) array (the
    fallback)."""
    if _LITTLE:
        words = planes[count:].astype(np.uint16)
        words <<= 8
        words |= planes[:count]
        return words
    values = np.empty((count, 2), dtype=np.uint8)
    values[:, 0] = planes[:count]
    values[:, 1] = planes[count:]
    return values.reshape(-1).view(np.uint16)


# from this many gaps up, torch's running sum in place beats numpy's (here 1.9 against
# 1.7 us at 512 gaps, 2.1 against 2.9 us at 1,024, 3.2 against 10 us at 3,754); below
# it, torch's fixed cost per call (about 1.6 us) is the larger
_TORCH_CUMSUM = 640


def _positions(planes: np.ndarray, count: int) -> np.ndarray:
    """The word positions (int64) the `count` gaps in `planes` (int32, 4 byte planes) give;
    `IntegrityError` unless every gap is at least 1. Gaps under 2**24 (every gap of a chunk
    of at most 32 MiB: the top plane all zeros) are laid out as int64 straight from their
    three low planes. A reader decodes hundreds of chunks a step, so each call's fixed cost
    counts: `count_nonzero` tests for zeros at a fraction of `any`'s and `all`'s."""
    if not count:
        return np.empty(0, dtype=np.int64)
    if _LITTLE and not np.count_nonzero(planes[3 * count :]):
        items = np.zeros((count, 8), dtype=np.uint8)
        items[:, 0] = planes[:count]
        items[:, 1] = planes[count : 2 * count]
        items[:, 2] = planes[2 * count : 3 * count]
        gaps = items.reshape(-1).view(np.int64)
        short = np.count_nonzero(gaps) != count  # each gap is 0 to 2**24 - 1 here
    else:
        gaps = _from_planes(planes, 4).view("<i4").astype(np.int64)
        short = int(gaps.min()) < 1
    if short:
        raise IntegrityError("changed-words delta chunk: positions out of order")
    gaps[0] -= 1  # word k is at gap_0 + ... + gap_k - 1
    if count < _TORCH_CUMSUM:
        np.add.accumulate(gaps, out=gaps)
    else:  # in place: numpy copies an input its output overlaps
        sums = torch.from_numpy(gaps)
        torch.cumsum(sums, 0, out=sums)
    return gaps


_LITTLE = sys.byteorder == "little"
_UINT: dict[int, type[np.unsignedinteger]] = {2: np.uint16, 4: np.uint32}


def _from_planes(planes: np.ndarray, width: int) -> np.ndarray:
    """`planes` (uint8: every item's first byte, then every second byte, ...; items of
    `width` bytes) as the items' bytes, item after item: integers built from the planes,
    shifted and ORed on a little-endian host, elsewhere a transposing copy (what a gap of
    2**24 words or more takes: `_positions`)."""
    count = planes.size // width
    if not _LITTLE or width not in _UINT:
        return planes.reshape(width, count).T.copy().reshape(-1)
    items = planes[(width - 1) * count :].astype(_UINT[width])
    for k in range(width - 2, -1, -1):
        items <<= 8
        items |= planes[k * count : (k + 1) * count]
    return items.view(np.uint8)


def apply(dest: Sequence[torch.Tensor], positions: np.ndarray, values: np.ndarray) -> None:
    """XOR `values` into the words at `positions` of the chunk `dest` (its segments, in
    place, on their device). A chunk in host memory is changed where it is, segment by
    segment when its segments are whole words; one on a device that spans tensors is
    joined, changed and copied back."""
    if not positions.size:
        return
    if len(dest) > 1 and all(p.device.type == "cpu" and p.numel() % 2 == 0 for p in dest):
        _apply_segments(dest, positions, values)
        return
    # numpy changes a host chunk where it is; an int16 view of a device one needs it aligned
    one = len(dest) == 1 and (dest[0].device.type == "cpu" or dest[0].data_ptr() % 2 == 0)
    chunk = dest[0] if one else torch.cat(list(dest))
    if chunk.device.type == "cpu":
        _xor_at(chunk.numpy().view(np.uint16), positions, values)
    else:
        xor_words(chunk, positions, values)
    if not one:
        copy_into(dest, chunk)


def _apply_segments(
    dest: Sequence[torch.Tensor], positions: np.ndarray, values: np.ndarray
) -> None:
    """`apply` to host segments of whole words each, in place (no joined copy): the
    positions (increasing) of each segment are a slice, found by bisection."""
    ends = np.cumsum([p.numel() // 2 for p in dest])
    cuts = np.searchsorted(positions, ends).tolist()
    start = lo = 0
    for part, end, hi in zip(dest, ends.tolist(), cuts, strict=True):
        if hi > lo:
            _xor_at(part.numpy().view(np.uint16), positions[lo:hi] - start, values[lo:hi])
        start, lo = end, hi


def xor_host(segments: Sequence[memoryview], positions: np.ndarray, values: np.ndarray) -> None:
    """`apply` to a chunk in host memory given as its segments' writable byte views, each
    of whole words (`HeldVersion.source_views`), in place: no tensor is made for it.

    Each segment is read through once first (its xxh3, thrown away: a streaming read, at
    the memory's bandwidth), so that the gather of its changed words finds them in the
    cache. A reader applies to memory it last wrote a whole version ago, out of every
    cache, and the gather alone waits on each line it touches in turn: for 288 chunks of
    256 KiB with 1.3 % of the words changed, the gather and the result's xxh3 after it took
    11-14 ms here, and with the read first 7-9 ms, that read included."""
    if len(segments) == 1:
        xxhash.xxh3_64_intdigest(segments[0])
        _xor_at(np.frombuffer(segments[0], dtype=np.uint16), positions, values)
        return
    start = lo = 0
    for view in segments:
        end = start + len(view) // 2
        hi = int(np.searchsorted(positions, end))
        if hi > lo:
            xxhash.xxh3_64_intdigest(view)
            words = np.frombuffer(view, dtype=np.uint16)
            _xor_at(words, positions[lo:hi] - start, values[lo:hi])
        start, lo = end, hi


def _xor_at(words: np.ndarray, positions: np.ndarray, values: np.ndarray) -> None:
    """`words[positions] ^= values` (positions distinct), as a gather, an XOR in place and a
    scatter: numpy's in-place operator on an index takes a quarter longer here."""
    found = words.take(positions)
    np.bitwise_xor(found, values, out=found)
    words[positions] = found


def xor_words(chunk: torch.Tensor, positions: np.ndarray, values: np.ndarray) -> None:
    """XOR `values` into the 2-byte words at `positions` of `chunk` (flat uint8, 2-byte
    aligned) with torch operations on its own device: how a chunk in device memory is
    changed (the positions and words, a few KiB, go to the device; the chunk stays)."""
    words = chunk.view(torch.int16)
    where = torch.from_numpy(positions).to(chunk.device)
    xor = torch.from_numpy(values.view(np.int16)).to(chunk.device)
    words[where] = words[where] ^ xor


def copy_into(dest: Sequence[torch.Tensor], payload: torch.Tensor) -> None:
    """Copy a chunk's payload into its segments `dest` (any devices)."""
    at = 0
    for part in dest:
        n = int(part.numel())
        part.copy_(payload[at : at + n])
        at += n
