"""The reader's delta applier (`ros.client.delta_apply.Applier`) on real tensors: chunks
applied on several threads end on the version's bytes, each marked present; a chunk whose
destination is not the base fails alone and is counted; chunks queued past the deadline or
at `close()` are left untouched for the rounds; and the changed-words decoder's two ways of
building positions (gaps under 2**24, and any gap) agree with the format."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest
import torch

from ros.client.delta_apply import Applier
from ros.client.delta_chunks import BaseCheck, Link
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.checksum_kinds import XXH3
from tensorhub.delta_rules import ENCODING, TENSOR
from tensorhub.errors import IntegrityError
from transport import delta as codec
from transport import delta_words
from transport.layout import Layout
from transport.store import HeldVersion

CHUNK = 64 << 10


def _versions() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two versions of a small model: about 2 % of the words changed in their low bits."""
    gen = torch.Generator().manual_seed(5)
    old = {
        "a": torch.randn(300_000, generator=gen).to(torch.bfloat16),
        "b": torch.randn(77, 1001, generator=gen).to(torch.bfloat16),
    }
    new = {}
    for name, t in old.items():
        mask = torch.rand(t.shape, generator=gen) < 0.02
        new[name] = torch.where(mask, (t.float() * 1.003).to(torch.bfloat16), t)
    return old, new


def _delta(
    old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], layout: Layout
) -> tuple[pb.Manifest, torch.Tensor]:
    """v2's manifest with its delta section against v1, and its companion's one tensor."""
    base = HeldVersion.publisher("t", "m", 1, old, layout)
    now = HeldVersion.publisher("t", "m", 2, new, layout)
    blobs = []
    for i in range(layout.num_chunks):
        blob = codec.encode(base.chunk_parts(i), now.chunk_parts(i))
        assert blob is not None
        blobs.append(blob)
    section = pb.Delta(
        base=1, encoding=ENCODING, encoded_bytes=[len(b) for b in blobs],
        encoded_xxh3=[codec.digest(b) for b in blobs], companion="m.delta",
        base_checksum=[codec.chunk_checksum(base, i, XXH3) for i in range(layout.num_chunks)],
    )  # fmt: skip
    sums = [codec.chunk_checksum(now, i, XXH3) for i in range(layout.num_chunks)]
    manifest = pb.Manifest(chunk_size=layout.chunk_size, chunk_xxh3=sums, delta=section)
    return manifest, torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)


Model = tuple[Layout, dict[str, torch.Tensor], dict[str, torch.Tensor], pb.Manifest, torch.Tensor]


@pytest.fixture(scope="module")
def model() -> Model:
    old, new = _versions()
    layout = Layout.from_tensors(old, CHUNK)
    manifest, companion = _delta(old, new, layout)
    return layout, old, new, manifest, companion


def _dest(layout: Layout, old: dict[str, torch.Tensor]) -> HeldVersion:
    return HeldVersion.reader("t", "m", 2, layout, {k: v.clone() for k, v in old.items()})


def _checker(dest: HeldVersion, manifest: pb.Manifest) -> tuple[BaseCheck, list[int]]:
    mismatches: list[int] = []
    check = BaseCheck(dest, manifest.delta.base_checksum, XXH3, lambda: mismatches.append(1))
    return check, mismatches


@pytest.mark.parametrize("threads", [1, 3])
def test_every_chunk_ends_on_the_versions_bytes_and_is_present(model: Model, threads: int) -> None:
    layout, old, new, manifest, companion = model
    dest = _dest(layout, old)
    check, mismatches = _checker(dest, manifest)
    todo = list(range(layout.num_chunks))
    with Applier([Link(2, manifest)], dest, todo, XXH3, check, threads=threads) as applier:
        applier.finish([{TENSOR: companion}], end=time.monotonic() + 60)
    assert (applier.done, applier.failed, mismatches) == (len(todo), 0, [])
    assert dest.complete
    for name, t in new.items():
        assert torch.equal(dest.tensors[name].view(torch.int16), t.view(torch.int16)), name


def test_a_chunk_that_is_not_the_base_fails_alone_and_is_counted(model: Model) -> None:
    layout, old, new, manifest, companion = model
    tampered = {k: v.clone() for k, v in old.items()}
    tampered["a"].view(torch.int16)[10] ^= 0x0100  # chunk 0 of the destination is not v1
    dest = HeldVersion.reader("t", "m", 2, layout, tampered)
    before = tampered["a"][: CHUNK // 2].clone()
    check, mismatches = _checker(dest, manifest)
    todo = list(range(layout.num_chunks))
    with Applier([Link(2, manifest)], dest, todo, XXH3, check, threads=2) as applier:
        applier.finish([{TENSOR: companion}], end=time.monotonic() + 60)
    assert (applier.done, applier.failed, mismatches) == (len(todo) - 1, 1, [1])
    assert dest.missing() == [0]  # read whole by the rounds
    assert torch.equal(tampered["a"][: CHUNK // 2].view(torch.int16), before.view(torch.int16))
    assert torch.equal(tampered["b"].view(torch.int16), new["b"].view(torch.int16))


def test_past_the_deadline_the_queued_chunks_are_left_untouched(model: Model) -> None:
    """`finish` with its end passed starts no chunk (none was started before it): every
    chunk keeps the base's bytes and stays missing, and after `close()` nothing changes."""
    layout, old, new, manifest, companion = model
    dest = _dest(layout, old)
    check, _ = _checker(dest, manifest)
    todo = list(range(layout.num_chunks))
    with Applier([Link(2, manifest)], dest, todo, XXH3, check, threads=1) as applier:
        applier.finish([{TENSOR: companion}], end=0.0)
    left = dest.missing()
    assert sorted(left) == todo  # decided before a thread could start one: no race
    assert applier.done == 0
    assert applier.failed == 0
    base = HeldVersion.publisher("t", "m", 1, old, layout)
    for i in range(layout.num_chunks):
        want = base if i in left else HeldVersion.publisher("t", "m", 2, new, layout)
        assert codec.chunk_checksum(dest, i, XXH3) == codec.chunk_checksum(want, i, XXH3), i
    snapshot = {k: v.clone() for k, v in dest.tensors.items()}
    applier.finish([{TENSOR: companion}], end=time.monotonic() + 60)  # closed: nothing is queued
    assert all(torch.equal(snapshot[k], v) for k, v in dest.tensors.items())


def test_chunks_land_from_other_threads_while_others_apply(model: Model) -> None:
    """The companion's chunks told from several receiving threads at once: each encoded
    chunk is applied once, and only once its bytes are in."""
    layout, old, new, manifest, companion = model
    dest = _dest(layout, old)
    check, _ = _checker(dest, manifest)
    spec = Layout.from_tensors({TENSOR: companion}, 4096)
    held = HeldVersion.reader("t", "m.delta", 2, spec, {TENSOR: companion})
    todo = list(range(layout.num_chunks))
    with Applier([Link(2, manifest)], dest, todo, XXH3, check, threads=2) as applier:
        told = applier.watch(held)
        pieces = list(range(spec.num_chunks))

        def land(mine: list[int]) -> None:
            for c in mine:
                held.mark_present(c, None)
                told(c)

        lands = [threading.Thread(target=land, args=(pieces[k::3],)) for k in range(3)]
        for t in lands:
            t.start()
        for t in lands:
            t.join(timeout=30)
        applier.finish([{TENSOR: companion}], end=time.monotonic() + 60)
    assert (applier.done, applier.failed) == (len(todo), 0)
    for name, t in new.items():
        assert torch.equal(dest.tensors[name].view(torch.int16), t.view(torch.int16)), name


@pytest.mark.parametrize(
    "idx", [[0, 1, 2, 70_000], [5, (1 << 24) + 9, (1 << 25) - 1], [(1 << 24) - 1, 1 << 24]]
)
def test_changed_word_positions_decode_with_gaps_of_any_size(idx: list[int]) -> None:
    """Gaps under 2**24 (every chunk up to 32 MiB) and larger ones decode to the positions
    encoded; a zero gap (a position twice) is refused either way."""
    words = 1 << 25
    positions = np.array(idx, dtype=np.int64)
    values = np.arange(1, 2 * len(idx) + 1, dtype=np.uint8).reshape(-1, 2)
    got, xor = delta_words.decode(delta_words.encode(words, positions, values, 1), words)
    assert got.tolist() == idx
    assert xor.tobytes() == values.tobytes()
    twice = np.array([*idx[:-1], idx[-2]], dtype=np.int64)
    with pytest.raises(IntegrityError, match="out of order"):
        delta_words.decode(delta_words.encode(words, twice, values, 1), words)


@pytest.mark.parametrize("little", [True, False])
def test_changed_words_decode_from_their_planes_either_way(
    little: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The XOR words come back as the bytes the encoder planed, whether built by shifting
    the second plane over the first (little-endian hosts) or by writing both planes into
    the columns of a copy (any host)."""
    if little and sys.byteorder != "little":
        pytest.skip("the shifted planes are a little-endian host's words")
    monkeypatch.setattr(delta_words, "_LITTLE", little)
    words = 1 << 17
    positions = np.array([3, 4, 900, 131_071], dtype=np.int64)
    values = np.array([[1, 0], [0, 255], [0xAB, 0xCD], [7, 9]], dtype=np.uint8)
    got, xor = delta_words.decode(delta_words.encode(words, positions, values, 1), words)
    assert got.tolist() == positions.tolist()
    assert xor.dtype == np.uint16
    assert xor.tobytes() == values.tobytes()


def test_chunks_applied_together_decode_their_changed_words_at_once(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On one thread, the chunks queued together are decoded in one `decode_words` call
    (not one `codec.apply` each), and end on the version's bytes, each marked present."""
    layout, old, new, manifest, companion = model
    calls: list[int] = []
    real = codec.decode_words

    def decode_words(
        encoded: list[memoryview], sizes: list[int]
    ) -> list[delta_words.Decoded | IntegrityError]:
        calls.append(len(encoded))
        return real(encoded, sizes)

    def apply(*_: object) -> None:
        raise AssertionError("a chunk of the changed-words form applied alone")

    monkeypatch.setattr(codec, "decode_words", decode_words)
    monkeypatch.setattr(codec, "apply", apply)
    dest = _dest(layout, old)
    check, mismatches = _checker(dest, manifest)
    todo = list(range(layout.num_chunks))
    with Applier([Link(2, manifest)], dest, todo, XXH3, check, threads=1) as applier:
        applier.finish([{TENSOR: companion}], end=time.monotonic() + 60)
    assert (applier.done, applier.failed, mismatches) == (len(todo), 0, [])
    assert sum(calls) == len(todo)
    assert max(calls) > 1
    for name, t in new.items():
        assert torch.equal(dest.tensors[name].view(torch.int16), t.view(torch.int16)), name


@pytest.mark.parametrize("little", [True, False])
def test_frames_decoded_together_give_what_each_gives_alone(
    little: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`decode_many` over frames of gaps of any size, with empty ones between them, gives
    each frame's positions and words as `decode` does alone (on any host: elsewhere than
    little-endian it decodes each alone); a frame with a repeated position, or one past
    its chunk, is refused as alone, and the others still decode; so too in batches of two
    and one (too few to join: each decoded alone)."""
    if little and sys.byteorder != "little":
        pytest.skip("needs a little-endian host: the joined planes are read as its words")
    monkeypatch.setattr(delta_words, "_LITTLE", little)
    words = 1 << 25
    lists = [[0, 1, 2, 70_000], [], [5, (1 << 24) + 9, (1 << 25) - 1], [(1 << 24) - 1, 1 << 24],
             [], [3], [7, 7], [words - 1]]  # fmt: skip

    def frame(idx: list[int], size: int = words) -> bytes:
        positions = np.array(idx, dtype=np.int64)
        values = (np.arange(2 * len(idx), dtype=np.int64) % 251 + 1).astype(np.uint8)
        return delta_words.encode(size, positions, values.reshape(-1, 2), 1)

    frames = [frame(idx) for idx in lists]
    frames.append(frame([3, words - 1], size=words + 8))  # a chunk larger than its own
    frames.append(frame([3, words + 5]))  # a position past its chunk
    sizes = [words] * len(frames)
    for batch in (len(frames), 2, 1):  # together, and in batches too small to join
        got = [
            decoded
            for k in range(0, len(frames), batch)
            for decoded in delta_words.decode_many(frames[k : k + batch], sizes[k : k + batch])
        ]
        _decoded_as_alone(frames, sizes, got)


def _decoded_as_alone(
    frames: list[bytes], sizes: list[int], got: list[delta_words.Decoded | IntegrityError]
) -> None:
    assert len(got) == len(frames)
    for blob, size, decoded in zip(frames, sizes, got, strict=True):
        if isinstance(decoded, IntegrityError):
            with pytest.raises(IntegrityError) as alone:
                delta_words.decode(blob, size)
            assert type(alone.value) is type(decoded)
            continue
        want = delta_words.decode(blob, size)
        assert decoded[0].tolist() == want[0].tolist()
        assert decoded[1].tolist() == want[1].tolist()
    assert [isinstance(d, IntegrityError) for d in got] == [False] * 6 + [True, False, True, True]
