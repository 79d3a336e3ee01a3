"""The delta codec (`transport.delta`): lossless both ways, whole when not worth it, and a
corrupt or mismatched encoding refused before a byte of the destination changes. The CUDA
cases run where a GPU exists (encoding and applying on the tensors' own device) and are
skipped here with the reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorhub.delta_rules import PLANES
from tensorhub.errors import IntegrityError
from transport import delta, delta_words
from transport.checksums import WSUM64, XXH3
from transport.layout import Layout
from transport.store import HeldVersion

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def bf16(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def nudged(t: torch.Tensor, share: float, seed: int) -> torch.Tensor:
    """`share` of the elements changed in their low bits, as an RL step changes them."""
    mask = torch.rand(t.shape, generator=torch.Generator().manual_seed(seed)) < share
    return torch.where(mask, (t.float() * 1.003).to(torch.bfloat16), t)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_a_sparse_change_encodes_small_and_applies_exactly() -> None:
    base = bf16(1 << 20, 1)
    new = nudged(base, 0.01, 2)
    encoded = delta.encode([u8(base)], [u8(new)])
    assert encoded is not None
    assert len(encoded) < 0.05 * base.numel() * 2  # ~1 % changed: a few % of the bytes
    dest = base.clone()
    delta.apply([u8(dest)], encoded)
    assert torch.equal(u8(dest), u8(new))


@pytest.mark.parametrize("share", [0.0, 0.001, 0.02, 0.2, 0.6])
def test_each_density_takes_its_form_and_round_trips(share: float) -> None:
    """Up to a quarter of the words changed: the changed words (applying touches only
    them); more: byte planes of the XOR. Either applies exactly, in one segment or split
    across segments at an odd byte (a word that straddles two tensors)."""
    base = bf16(1 << 16, 21)
    new = nudged(base, share, 22)
    changed = int((base.view(torch.int16) != new.view(torch.int16)).sum())
    encoded = delta.encode([u8(base)], [u8(new)])
    assert encoded is not None
    want = delta.WORDS if changed <= delta_words.MAX_SHARE * base.numel() else delta.DENSE
    assert encoded[:1] == want
    for cut in (None, 1001):
        dest = base.clone()
        parts = [u8(dest)] if cut is None else [u8(dest)[:cut], u8(dest)[cut:]]
        delta.apply(parts, encoded)
        assert torch.equal(dest, new)


def test_the_changed_words_are_found_at_any_length_and_offset() -> None:
    """The 8-byte block scan and the word scan (a length not a multiple of 8, a payload that
    starts at an odd word) find the same words, whatever their place in a block."""
    g = torch.Generator().manual_seed(23)
    for length, start in ((4096, 0), (4094, 0), (4096, 2), (18, 6)):
        old = torch.randint(0, 256, (length + start,), dtype=torch.uint8, generator=g)[start:]
        new = old.clone()
        at = torch.randperm(length // 2, generator=g)[: max(1, length // 64)]
        new.view(torch.int16)[at] ^= 0x0101
        found = delta_words.changed(old, new)
        assert found is not None
        idx, values = found
        assert sorted(idx.tolist()) == sorted(at.tolist()) == idx.tolist()
        assert (values.view("<u2").reshape(-1) == 0x0101).all()


@pytest.mark.parametrize("share", [0.01, 0.6, 1.0])
def test_advance_brings_the_base_to_the_new_chunk_whatever_its_form(share: float) -> None:
    """`encode(advance=True)`, as a publisher's base copy is kept: the changed words
    written (sparse), the chunk copied (dense, or sent whole), in one segment or across
    two at an odd byte; the encoding is the one `advance=False` makes."""
    base = bf16(1 << 15, 27)
    new = nudged(base, share, 28) if share < 1 else bf16(1 << 15, 29)
    plain = delta.encode([u8(base)], [u8(new)])
    for cut in (None, 777):
        copy = base.clone()
        parts = [u8(copy)] if cut is None else [u8(copy)[:cut], u8(copy)[cut:]]
        assert delta.encode(parts, [u8(new)], advance=True) == plain
        assert torch.equal(copy, new)


def test_the_first_encoding_still_applies() -> None:
    """A manifest naming `xor-shuffle-zstd1` (every chunk byte planes, no form byte), as the
    first publishers wrote it."""
    base = bf16(1 << 16, 24)
    new = nudged(base, 0.01, 25)
    first = delta._planes(torch.bitwise_xor(u8(base), u8(new)))
    dest = base.clone()
    delta.apply([u8(dest)], first, PLANES)
    assert torch.equal(dest, new)
    with pytest.raises(IntegrityError, match="unknown delta encoding"):
        delta.apply([u8(dest)], first, "xor-bogus")


def test_a_changed_words_frame_that_lies_is_refused_before_writing() -> None:
    """Counts past the chunk, positions out of order or past its end, another chunk
    size, a short frame: `IntegrityError`, and the destination is untouched."""
    import numpy as np
    import zstandard

    words = 512
    base = bf16(words, 26)

    def frame(total: int, gaps: list[int], count: int | None = None) -> bytes:
        g = np.array(gaps, dtype="<i4")
        body = np.concatenate([g.view(np.uint8).reshape(-1, 4).T.reshape(-1),
                               np.ones(2 * len(gaps), dtype=np.uint8)])  # fmt: skip
        n = len(gaps) if count is None else count
        head = total.to_bytes(4, "little") + n.to_bytes(4, "little")
        return delta.WORDS + head + zstandard.ZstdCompressor().compress(body.tobytes())

    good = frame(words, [1, 5, 7])
    dest = base.clone()
    delta.apply([u8(dest)], good)
    assert not torch.equal(dest, base)
    bad = [
        frame(words + 1, [1, 5, 7]),  # another chunk's size
        frame(words, [1, 0, 7]),  # a repeated position
        frame(words, [1, -3, 7]),  # backwards
        frame(words, [1, 5, words]),  # past the end
        frame(words, [1, 5, 7], count=4),  # a count the frame does not hold
        frame(words, [1, 5, 7], count=words + 1),  # more words than the chunk has
        delta.WORDS + b"\x01\x02",  # no header
        b"\x07" + good[1:],  # an unknown form
    ]
    for lie in bad:
        dest = base.clone()
        with pytest.raises(IntegrityError):
            delta.apply([u8(dest)], lie)
        assert torch.equal(dest, base)


def test_segments_and_odd_lengths_round_trip() -> None:
    """A chunk made of several tensors' bytes (no padding), one of odd length."""
    a, b = torch.arange(1001, dtype=torch.uint8), bf16(3000, 3)
    a2, b2 = a.clone(), nudged(b, 0.05, 4)
    a2[17] ^= 0x5A
    encoded = delta.encode([a, u8(b)], [a2, u8(b2)])
    assert encoded is not None
    dest = [a.clone(), u8(b.clone())]
    delta.apply(dest, encoded)
    assert torch.equal(dest[0], a2)
    assert torch.equal(dest[1], u8(b2))


def test_a_chunk_of_whole_word_segments_is_changed_where_it_lies() -> None:
    """A host chunk that spans tensors of whole words is changed in each tensor's own
    memory, as the joined chunk would be (no copy back)."""
    parts = [bf16(n, 60 + k) for k, n in enumerate([700, 1, 1300, 64])]
    new = [nudged(p, 0.05, 70 + k) for k, p in enumerate(parts)]
    found = delta_words.changed(torch.cat([u8(p) for p in parts]), torch.cat([u8(p) for p in new]))
    assert found is not None
    positions, values = found
    dest = [p.clone() for p in parts]
    delta_words.apply([u8(d) for d in dest], positions, values.view(np.uint16).reshape(-1))
    for d, want in zip(dest, new, strict=True):
        assert torch.equal(u8(d), u8(want))


def test_the_device_scatter_changes_the_words_the_host_scatter_does() -> None:
    """`xor_words` (torch operations: what a chunk in device memory takes) run here on host
    tensors gives the bytes the numpy scatter gives, and a one-segment host chunk at an odd
    address is still changed in place."""
    base = bf16(4099, 21)
    new = nudged(base, 0.02, 22)
    found = delta_words.changed(u8(base), u8(new))
    assert found is not None
    positions, values = found
    words = values.view(np.uint16).reshape(-1)
    by_torch = u8(base.clone())
    delta_words.xor_words(by_torch, positions, words)
    assert torch.equal(by_torch, u8(new))
    raw = torch.zeros(u8(base).numel() + 1, dtype=torch.uint8)
    odd = raw[1:]
    odd.copy_(u8(base))
    delta_words.apply([odd], positions, words)
    assert torch.equal(raw[1:], u8(new))


def test_a_dense_change_goes_whole() -> None:
    g = torch.Generator().manual_seed(5)
    base, new = (torch.randint(0, 256, (1 << 18,), dtype=torch.uint8, generator=g) for _ in "ab")
    assert delta.encode([base], [new]) is None  # every byte changed at random: whole


def test_a_corrupt_or_foreign_encoding_changes_nothing() -> None:
    base = bf16(1 << 16, 7)
    encoded = delta.encode([u8(base)], [u8(nudged(base, 0.01, 8))])
    assert encoded is not None
    dest = base.clone()
    broken = bytearray(encoded)
    broken[len(broken) // 2] ^= 0xFF
    with pytest.raises(IntegrityError):
        delta.apply([u8(dest)], bytes(broken[: len(broken) // 2]))  # cut short
    shorter = base[:-64].clone()
    with pytest.raises(IntegrityError):
        delta.apply([u8(shorter)], encoded)  # an encoding of another chunk size
    assert torch.equal(dest, base)
    assert delta.digest(encoded) != delta.digest(bytes(broken))


@pytest.mark.parametrize("kind", [XXH3, WSUM64])
def test_chunk_checksum_is_the_manifests(kind: str) -> None:
    tensors = {"a": bf16(5000, 9), "b": torch.arange(300, dtype=torch.int32)}
    layout = Layout.from_tensors(tensors, chunk_size=4096)
    held = HeldVersion.publisher("t", "m", 1, tensors, layout)
    for index in range(layout.num_chunks):
        want = held.checksum(index) if kind == XXH3 else held.wsum64(index)
        assert delta.chunk_checksum(held, index, kind) == want


@cuda
def test_on_a_gpu_the_encoding_is_the_hosts_and_applies_in_place() -> None:
    base = bf16(1 << 20, 10)
    new = nudged(base, 0.01, 11)
    on_host = delta.encode([u8(base)], [u8(new)])
    on_gpu = delta.encode([u8(base.cuda())], [u8(new.cuda())])
    assert on_gpu == on_host
    assert on_gpu is not None
    dest = base.cuda()
    delta.apply([u8(dest)], on_gpu)
    assert dest.device.type == "cuda"
    assert torch.equal(u8(dest).cpu(), u8(new))


@cuda
def test_a_host_base_encodes_a_gpu_version_on_the_gpu() -> None:
    """`publish(delta=True, base_copy="host")` of tensors in GPU memory: the base chunk is
    copied to the GPU, not the version to the host."""
    base = bf16(1 << 20, 13)
    new = nudged(base, 0.01, 14)
    encoded = delta.encode([u8(base)], [u8(new.cuda())])
    assert encoded == delta.encode([u8(base)], [u8(new)])


@cuda
@pytest.mark.parametrize("kind", [XXH3, WSUM64])
def test_on_a_gpu_chunk_checksums_match_the_hosts(kind: str) -> None:
    tensors = {"a": bf16(5000, 12)}
    layout = Layout.from_tensors(tensors, chunk_size=4096)
    host = HeldVersion.publisher("t", "m", 1, tensors, layout)
    gpu = HeldVersion.publisher("t", "m", 1, {"a": tensors["a"].cuda()}, layout)
    for index in range(layout.num_chunks):
        assert delta.chunk_checksum(gpu, index, kind) == delta.chunk_checksum(host, index, kind)


def test_the_byte_planes_are_the_formats_whatever_the_way_computed() -> None:
    """The fast planes (int16 casts) are byte for byte the format's definition (first
    bytes of every 2-byte word, then second bytes), and undo exactly: an encoding made on
    one machine applies on any other."""
    x = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=torch.Generator())
    reference = x.view(-1, 2).t().contiguous().view(-1)
    assert torch.equal(delta._shuffle(x), reference)
    assert torch.equal(delta._unshuffle(reference), x)
    odd = x[:-1]
    assert torch.equal(delta._unshuffle(delta._shuffle(odd)), odd)


@pytest.mark.parametrize("width", [2, 4, 3])
def test_changed_words_planes_undo_as_the_format_defines(width: int) -> None:
    """The changed-words decoder rebuilds the gaps (4 planes) and the XOR words (2 planes)
    from their byte planes with integer shifts; that is byte for byte the transposing copy
    the format defines (width 3 takes the copy itself), at any count, zero included."""
    g = torch.Generator().manual_seed(width)
    for count in (0, 1, 7, 4099):
        items = torch.randint(0, 256, (count, width), dtype=torch.uint8, generator=g).numpy()
        planes = items.T.reshape(-1)
        assert (delta_words._from_planes(planes, width) == items.reshape(-1)).all()
