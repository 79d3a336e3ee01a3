"""The delta codec against hostile encoded chunks (issue 38, rows 1 and 2; and row 4's
whole reader, at the end). A chunk is a publisher's bytes, its digest valid and its size
within the hub's 0.8 x chunk bound, yet its zstd frame may declare any content size.
python-zstandard sizes its output from that header and ignores `max_output_size` when there
is one, so on 292ed20 a 65 KB frame that declares 2 GiB (runs of zeros) made `apply`
allocate and write 2 GiB before it failed, and one that declares 1 TiB raised
`MemoryError`. Now the header is read first: a frame that does not declare exactly what its
chunk must decode to is `DeltaRefused` before anything is allocated, which tracemalloc
shows here (peak within the chunk's size plus 64 MiB)."""

from __future__ import annotations

import itertools
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
import xxhash
import zstandard

from tensorhub.errors import DeltaRefused, IntegrityError
from tests.transport._zstd_frames import frame, windowed, words_head
from transport import delta, delta_words
from transport.checks import STRICT
from transport.checksums import WSUM64, XXH3, multipliers_np, wsum64_reference
from transport.verification import ChunkVerifier, HostBytes

CHUNK = 1 << 20  # bytes of the chunk each hostile frame claims to be a delta of
SLACK = 64 << 20  # what a decode may use beyond the chunk's size (issue 38)


def bf16(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@contextmanager
def peak() -> Iterator[list[int]]:
    """The peak of Python-traced memory (zstd's output buffers, numpy arrays) in the block,
    above what was allocated when it started: `[bytes]` once it ends."""
    out: list[int] = []
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        yield out
        out.append(tracemalloc.get_traced_memory()[1] - start)
    finally:
        tracemalloc.stop()


def dense(declared: int | None, content: int | None = None) -> bytes:
    return delta.DENSE + frame(declared, content)


def words(declared: int | None, count: int, content: int | None = None) -> bytes:
    return delta.WORDS + words_head(CHUNK // 2, count) + frame(declared, content)


BOMBS: dict[str, Callable[[], bytes]] = {
    # the review's frame: 65 KB, declares 2 GiB and holds 2 GiB of zeros
    "dense, declares and holds 2 GiB": lambda: dense(2 << 30),
    "dense, declares 2 GiB, holds 1 KiB": lambda: dense(2 << 30, 1024),
    "dense, declares 1 TiB": lambda: dense(1 << 40, 1024),
    "dense, declares no size": lambda: dense(None, CHUNK),
    "dense, declares one byte too many": lambda: dense(CHUNK + 1),
    "words, declares and holds 2 GiB": lambda: words(2 << 30, 1000),
    "words, declares 1 TiB": lambda: words(1 << 40, 1000, 6000),
    "words, declares no size": lambda: words(None, 1000, 6000),
    # its count says 6 x 131072 bytes: more than a quarter of the words (what any
    # publisher ever wrote), refused before the frame is read
    "words, every word changed": lambda: words(6 * (CHUNK // 2), CHUNK // 2),
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_a_frame_that_declares_another_size_is_refused_before_it_is_decoded(name: str) -> None:
    """Row 1 (and row 2's `MemoryError`): every bomb is `DeltaRefused`, the destination is
    untouched, and no more than the chunk's size plus 64 MiB is allocated (on 292ed20 the
    2 GiB frames allocated 2,048 MiB, and the 1 TiB ones raised MemoryError)."""
    encoded = BOMBS[name]()
    assert len(encoded) <= 0.8 * CHUNK  # within the hub's bound: the hub lets it through
    dest = u8(bf16(CHUNK // 2, 1))
    before = dest.clone()
    with peak() as used, pytest.raises(DeltaRefused):
        delta.apply([dest], encoded)
    assert used[0] < CHUNK + SLACK, f"{name}: {used[0] >> 20} MiB"
    assert torch.equal(dest, before)


def test_the_first_encoding_refuses_a_bomb_too() -> None:
    """`xor-shuffle-zstd1` (byte planes, no form byte) goes through the same decode."""
    dest = u8(bf16(CHUNK // 2, 2))
    with peak() as used, pytest.raises(DeltaRefused):
        delta.apply([dest], frame(2 << 30), delta.PLANES)
    assert used[0] < CHUNK + SLACK


def test_a_frame_with_a_huge_window_but_the_right_size_decodes_within_bounds() -> None:
    """A frame that declares its right size but a window of 2**27..2**31 bytes: decoded in
    one shot, it needs no window; refused (past zstd's default limit) or decoded, never
    more than the chunk's size plus 64 MiB."""
    for log in (27, 30, 31):
        dest = u8(bf16(CHUNK // 2, 3))
        want = dest.clone()
        with peak() as used:
            try:
                delta.apply([dest], delta.DENSE + windowed(CHUNK, log))
            except IntegrityError:
                dest = want  # refused: a reader reads the chunk whole
        assert used[0] < CHUNK + SLACK, log
        assert torch.equal(dest, want)  # the XOR of zeros: the base itself


def test_trailing_bytes_after_the_frame_are_refused() -> None:
    """An encoding inflated past its frame (a valid frame and junk, or a second frame)
    does not apply: the bytes a digest covers are exactly the bytes decoded."""
    base = bf16(CHUNK // 2, 4)
    new = base.clone()
    new[::1000] += 1
    encoded = delta.encode([u8(base)], [u8(new)])
    assert encoded is not None
    for tail in (b"\0", b"junk" * 100, frame(16)):
        dest = u8(base.clone())
        with pytest.raises(IntegrityError):
            delta.apply([dest], encoded + tail)
        assert torch.equal(dest, u8(base))


@pytest.mark.parametrize("share", [0.0, 0.001, 0.05, 0.3, 1.0])
def test_every_frame_the_encoder_writes_declares_what_it_decodes_to(share: float) -> None:
    """The decode refuses a frame of unknown size, so the encoder must always write it: the
    dense form's frame declares the chunk's size, the changed-words form's 6 bytes per word
    its count says; each round-trips."""
    base = bf16(1 << 16, 5)
    mask = torch.rand(base.shape, generator=torch.Generator().manual_seed(6)) < share
    new = torch.where(mask, (base.float() * 1.01).to(torch.bfloat16), base)
    encoded = delta.encode([u8(base)], [u8(new)])
    if encoded is None:  # over 0.8 of the chunk: sent whole, no frame
        assert share == 1.0
        planes = delta._planes(torch.bitwise_xor(u8(base), u8(new)))
        assert zstandard.frame_content_size(planes) == base.numel() * 2
        return
    if encoded[:1] == delta.WORDS:
        count = int.from_bytes(encoded[5:9], "little")
        assert zstandard.frame_content_size(encoded[9:]) == 6 * count
    else:
        assert zstandard.frame_content_size(encoded[1:]) == base.numel() * 2
    dest = base.clone()
    delta.apply([u8(dest)], encoded)
    assert torch.equal(dest, new)


def test_a_changed_words_count_over_a_quarter_is_refused_but_a_quarter_applies() -> None:
    """What the first publishers of the form wrote (up to a quarter of the words) still
    decodes; one word more is refused before its frame is read."""
    n = 4096
    idx = np.arange(0, n, 4, dtype=np.int64)  # a quarter of the words
    values = np.full((idx.size, 2), 0x11, dtype=np.uint8)
    body = delta_words.encode(n, idx, values, level=1)
    positions, xor = delta_words.decode(body, n)
    assert positions.tolist() == idx.tolist()
    assert (xor == 0x1111).all()
    over = words_head(n, idx.size + 1) + body[8:]
    with pytest.raises(DeltaRefused):
        delta_words.decode(over, n)


def test_a_whole_reader_of_a_wsum64_delta_version_checks_its_xxh3_too() -> None:
    """Row 4, the whole reader's half: a chunk with the manifest's weighted sum but not the
    xxh3-64 its delta section records is not committed, whether the xxh3 is the holder's
    claim (TCP: the wire's hash) or computed; the honest chunk is; and without digests (a
    version with no delta) the weighted sum alone decides, as before."""
    honest = bytearray(u8(bf16(CHUNK // 2, 8)).numpy().tobytes())
    forged = bytearray(honest)
    words = np.frombuffer(forged, dtype="<u8")
    m = [int(x) for x in multipliers_np(2)]
    words[0] = (int(words[0]) + 1) % (1 << 64)  # word 0 + 1, word 1 - m0 / m1: same sum
    words[1] = (int(words[1]) - m[0] * pow(m[1], -1, 1 << 64)) % (1 << 64)
    assert wsum64_reference(bytes(forged)) == wsum64_reference(bytes(honest))
    sums, digest = [wsum64_reference(bytes(honest))], [xxhash.xxh3_64_intdigest(bytes(honest))]
    verify = ChunkVerifier(sums, WSUM64, STRICT, digest)
    assert verify.check(0, HostBytes([memoryview(honest)])) is None
    assert verify.check(0, HostBytes([memoryview(forged)])) is not None
    claimed = xxhash.xxh3_64_intdigest(bytes(forged))  # the holder's header, true to its bytes
    assert verify.check(0, HostBytes([memoryview(forged)], claimed), claimed) is not None
    assert ChunkVerifier(sums, WSUM64, STRICT).check(0, HostBytes([memoryview(forged)])) is None
    # digests are for a linear checksum: under xxh3-64 the checksums are those already
    assert (
        ChunkVerifier(digest, XXH3, STRICT, [0]).check(0, HostBytes([memoryview(honest)])) is None
    )


def _lying_words(total: int, gaps: list[int], count: int | None = None) -> bytes:
    """A changed-words encoding of a chunk of `total` words listing `gaps` (XOR words of
    ones), stating `count` changed words (default: as many as the gaps)."""
    g = np.array(gaps, dtype="<i4")
    body = np.concatenate([g.view(np.uint8).reshape(-1, 4).T.reshape(-1),
                           np.ones(2 * len(gaps), dtype=np.uint8)])  # fmt: skip
    n = len(gaps) if count is None else count
    return delta.WORDS + words_head(total, n) + zstandard.ZstdCompressor().compress(body.tobytes())


LIES: dict[str, Callable[[], bytes]] = {
    **{f"bomb: {name}": make for name, make in BOMBS.items()},
    "another chunk's size": lambda: _lying_words(CHUNK // 2 + 1, [1, 5, 7]),
    "a repeated position": lambda: _lying_words(CHUNK // 2, [1, 0, 7]),
    "backwards": lambda: _lying_words(CHUNK // 2, [1, -3, 7]),
    "a gap of 2**24 to a repeated position": lambda: _lying_words(CHUNK // 2, [1 << 24, 0]),
    "past the end": lambda: _lying_words(CHUNK // 2, [1, 5, CHUNK // 2]),
    "one word past the end": lambda: _lying_words(CHUNK // 2, [CHUNK // 2 + 1]),
    "a count the frame does not hold": lambda: _lying_words(CHUNK // 2, [1, 5, 7], count=4),
    "no header": lambda: delta.WORDS + b"\x01\x02",
    "an unknown form": lambda: b"\x07" + _lying_words(CHUNK // 2, [1, 5])[1:],
}


def _honest(seed: int, share: float) -> tuple[torch.Tensor, torch.Tensor, bytes]:
    base = bf16(CHUNK // 2, seed)
    mask = torch.rand(base.shape, generator=torch.Generator().manual_seed(seed + 1)) < share
    new = torch.where(mask, (base.float() * 1.01).to(torch.bfloat16), base)
    encoded = delta.encode([u8(base)], [u8(new)])
    assert encoded is not None
    assert encoded[:1] == delta.WORDS
    return u8(base), u8(new), encoded


@pytest.mark.parametrize("name", list(LIES))
def test_decoding_chunks_together_refuses_what_apply_refuses_alone(name: str) -> None:
    """`decode_words` (a reader's chunks decoded together) between honest chunks: a lie of
    the changed-words form gets the error type `apply` raises for it alone (`DeltaRefused`
    for every bomb, within the same memory bound), one of another form an `IntegrityError`
    before it is decoded; the honest chunks decode to what they decode to alone, whatever
    the lie's place among them."""
    lie = LIES[name]()
    dest = u8(bf16(CHUNK // 2, 1))
    with pytest.raises(IntegrityError) as alone:
        delta.apply([dest.clone()], lie)
    honest = [_honest(seed, share) for seed, share in ((10, 0.01), (20, 0.0), (30, 0.05))]
    for at in range(len(honest) + 1):
        blobs = [h[2] for h in honest]
        blobs.insert(at, lie)
        with peak() as used:
            got = delta.decode_words(blobs, [CHUNK] * len(blobs))
        assert used[0] < 2 * CHUNK + SLACK, f"{name}: {used[0] >> 20} MiB"
        if lie[:1] == delta.WORDS:
            assert type(got[at]) is type(alone.value), (name, got[at])
        else:  # not decoded at all: a reader applies it alone (`apply`), which refuses it
            assert isinstance(got[at], IntegrityError), (name, got[at])
        for k, (base, new, blob) in enumerate(honest):
            decoded = got[k + (k >= at)]
            assert not isinstance(decoded, IntegrityError), decoded
            positions, values = delta_words.decode(memoryview(blob)[1:], CHUNK // 2)
            assert decoded[0].tolist() == positions.tolist()
            assert decoded[1].tolist() == values.tolist()
            chunk = base.clone()
            delta.apply_words([chunk.numpy().data.cast("B")], decoded)
            assert torch.equal(chunk, new)


def test_changed_words_applied_in_segments_as_alone() -> None:
    """`apply_words` on a chunk given as several segments' views (whole words each) writes
    what `apply` writes on the chunk joined; applied again, the chunk is the base."""
    base, new, blob = _honest(40, 0.02)
    (decoded,) = delta.decode_words([blob], [CHUNK])
    assert not isinstance(decoded, IntegrityError)
    chunk = base.clone()
    cuts = [0, 2, 4096, 4098, CHUNK // 2, CHUNK]
    views = [chunk[a:b].numpy().data.cast("B") for a, b in itertools.pairwise(cuts)]
    delta.apply_words(views, decoded)
    assert torch.equal(chunk, new)
    delta.apply_words(views, decoded)
    assert torch.equal(chunk, base)
