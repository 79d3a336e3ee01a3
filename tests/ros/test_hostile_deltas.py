"""Delta readers against a hostile publisher of their own tenant (issue 38, rows 1-4, and the
fuzz of hostile delta chunks). The publisher here is the SDK with its codec or its
companion swapped (what a modified client publishes); each delta chunk it spoils carries a
valid digest and fits the hub's 0.8 x chunk bound, so only the reader can refuse it.

- row 1: a chunk whose zstd frame declares 2 GiB. On 292ed20 every delta reader allocated
  and wrote 2 GiB (measured here as the peak RSS of a reader process); now the frame is
  refused from its header and the chunk read whole, the peak within the chunk plus 64 MiB;
- row 2: one that declares 1 TiB made `fetch` raise `MemoryError`, and any other exception
  of a chunk's apply escaped the fetch; now a failing chunk fails alone and is read whole;
- row 3: a companion padded (or cut) to another size than its version's manifest states
  was downloaded and kept; now it is refused before any of it is read, and v read whole;
- row 4: under `wsum64` (linear) a delta that decodes to other bytes with the same
  weighted sum left delta readers on bytes that no whole reader holds; now every reader
  checks the xxh3-64 the delta section records for each chunk (`result_xxh3`);
- the fuzz: corrupt, truncated, inflated and bomb-shaped chunks end a reader on the
  publisher's bytes, within the chunk's size plus 64 MiB of traced memory.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ros
from ros.client import delta_publish
from ros.client.deadline import Deadline
from ros.client.delta_chunks import Encoded, Link, apply_many, apply_one
from ros.client.delta_publish import BaseCopies
from ros.hub.server import HubServer
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.checksum_kinds import WSUM64, XXH3
from tensorhub.delta_rules import ENCODING, TENSOR, companion_of
from tensorhub.errors import IntegrityError
from tests.transport._zstd_frames import frame, words_head
from transport import delta as codec
from transport import delta_words
from transport.checksums import multipliers_np, wsum64_reference
from transport.layout import Layout
from transport.store import HeldVersion

CHUNK = 1 << 20  # one tensor a chunk: the bombs of the review fit 0.8 x 1 MiB
N = 8  # tensors (and chunks) of the model: 8 MiB
BAD = 3  # the chunk a hostile publisher spoils
SLACK = 64 << 20  # what a reader may use beyond a chunk's size (issue 38)
Parts = Sequence[torch.Tensor]
Make = Callable[[Parts, Parts, bool], "bytes | None"]


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(CHUNK // 2, generator=g).to(torch.bfloat16) for i in range(N)}


def step(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The next version: 1 % of the elements nudged, as an RL step changes them."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        mask = torch.rand(t.shape, generator=g) < 0.01
        out[name] = torch.where(mask, (t.float() * 1.01).to(torch.bfloat16), t)
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a
    )


def digests(w: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        k: xxhash.xxh3_64_hexdigest(t.contiguous().view(-1).view(torch.uint8).numpy())
        for k, t in sorted(w.items())
    }


class HostileCodec:
    """`transport.delta` as a hostile publisher's SDK uses it: chunk `BAD` of every publish
    is encoded by `make(base, new, advance)`, every other chunk honestly."""

    def __init__(self, make: Make) -> None:
        self.make, self.calls = make, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(codec, name)

    def encode(self, base: Parts, new: Parts, *, advance: bool = False) -> bytes | None:
        index, self.calls = self.calls % N, self.calls + 1
        if index == BAD:
            return self.make(base, new, advance)
        return codec.encode(base, new, advance=advance)


def spoiled(bytes_of: Callable[[bytes], bytes]) -> Make:
    """The honest encoding (the base copy brought to the new chunk, as it is) made hostile."""

    def make(base: Parts, new: Parts, advance: bool) -> bytes:
        honest = codec.encode(base, new, advance=advance)
        assert honest is not None
        return bytes_of(honest)

    return make


def dense_bomb(declared: int, content: int | None = None) -> Make:
    return spoiled(lambda _: codec.DENSE + frame(declared, content))


def words_bomb(declared: int) -> Make:
    return spoiled(lambda _: codec.WORDS + words_head(CHUNK // 2, 1000) + frame(declared))


def flipped(encoded: bytes) -> bytes:
    """One byte in the middle of the frame changed."""
    out = bytearray(encoded)
    out[len(out) // 2] ^= 0x5A
    return bytes(out)


HOSTILE: dict[str, Make] = {
    "corrupt": spoiled(flipped),
    "truncated": spoiled(lambda e: e[: len(e) // 2]),
    "inflated": spoiled(lambda e: e + b"\0" * 4096),
    "another form": spoiled(lambda e: b"\x07" + e[1:]),
    "dense bomb, 2 GiB": dense_bomb(2 << 30),
    "dense bomb, 1 TiB": dense_bomb(1 << 40, 4096),
    "words bomb, 2 GiB": words_bomb(2 << 30),
    "no content size": spoiled(lambda _: codec.DENSE + frame(None, CHUNK)),
}


@pytest.fixture
def hostile(monkeypatch: pytest.MonkeyPatch) -> Callable[[Make], None]:
    """Make this process's publishers hostile: `hostile(make)` swaps their codec."""
    return lambda make: monkeypatch.setattr(delta_publish, "codec", HostileCodec(make))


# -- rows 1 and 2: bombs, and a chunk that raises anything ---------------------------------


@contextmanager
def reader_process(hub_server: HubServer, token: str) -> Iterator[Callable[[], dict[str, Any]]]:
    """A reader process that fetched policy@1; calling what this yields makes it fetch
    policy@2 into the same memory and returns its report (hostile_delta_reader_proc)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.ros.hostile_delta_reader_proc", hub_server.address,
         "team-a", token, "policy", "1", "2"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdin is not None
    try:
        assert json.loads(proc.stdout.readline()) == {"ready": True}

        def fetch() -> dict[str, Any]:
            assert proc.stdout is not None
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            assert line, "the reader process exited"
            report: dict[str, Any] = json.loads(line)
            return report

        yield fetch
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize("bomb", ["dense bomb, 2 GiB", "words bomb, 2 GiB"])
@pytest.mark.timeout(120)
def test_row1_a_bomb_chunk_costs_a_reader_no_more_than_its_chunk(
    bomb: str,
    hub_server: HubServer,
    make_tenant: Callable[[str], str],
    hostile: Callable[[Make], None],
) -> None:
    """A 65 KB frame that declares (and holds) 2 GiB: the reader process's peak RSS during
    the fetch stays within its RSS before it plus the chunk plus 64 MiB (on 292ed20: +2 GiB),
    the chunk is read whole, and the others are applied."""
    token = make_tenant("team-a")
    trainer = ros.connect(hub_server.address, tenant="team-a", token=token)
    try:
        w = model(1)
        trainer.publish("policy", 1, w, chunk_size=CHUNK, delta=True)
        with reader_process(hub_server, token) as fetch:
            hostile(HOSTILE[bomb])
            w2 = step(w, 2)
            trainer.publish("policy", 2, w2, chunk_size=CHUNK, delta=True)
            report = fetch()
    finally:
        trainer.close()
    assert "error" not in report, report
    assert report["xxh3"] == digests(w2)  # the publisher's bytes
    grew = report["peak"] - report["rss"]
    assert grew < CHUNK + SLACK, f"the reader grew by {grew >> 20} MiB"
    assert report["delta"]["chunks"] == N - 1, report["delta"]
    assert report["delta"]["whole_chunks"] == 1, report["delta"]


def publish_and_read(
    connect: Callable[..., ros.Hub], make: Make | None, hostile: Callable[[Make], None]
) -> tuple[ros.Held, dict[str, torch.Tensor]]:
    """policy@1 honest, read; policy@2 by `make` (None: honest), read into the same memory."""
    trainer, reader = connect(), connect()
    w = model(3)
    trainer.publish("policy", 1, w, chunk_size=CHUNK, delta=True)
    held = reader.fetch("policy", 1)
    held.release()
    if make is not None:
        hostile(make)
    w2 = step(w, 4)
    trainer.publish("policy", 2, w2, chunk_size=CHUNK, delta=True)
    return reader.fetch("policy", 2, into=held.tensors), w2


def test_row2_a_frame_declaring_a_tebibyte_reads_its_chunk_whole(
    connect: Callable[..., ros.Hub], hostile: Callable[[Make], None]
) -> None:
    """On 292ed20 `fetch` raised MemoryError."""
    again, w2 = publish_and_read(connect, HOSTILE["dense bomb, 1 TiB"], hostile)
    assert same(again.tensors, w2)
    assert again.delta is not None
    assert (again.delta.chunks, again.delta.whole_chunks) == (N - 1, 1), again.delta


@pytest.mark.parametrize(
    "error",
    [MemoryError(), zstandard.ZstdError("bad frame"), ValueError("x"), RuntimeError("CUDA")],
    ids=lambda e: type(e).__name__,
)
def test_row2_whatever_a_chunk_raises_it_fails_alone(
    error: Exception,
    connect: Callable[..., ros.Hub],
    hostile: Callable[[Make], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Applying chunk `BAD` raises (memory, a codec's error, a runtime error): that chunk is
    read whole, the others applied, and the fetch ends on the publisher's bytes (on
    292ed20 only an IntegrityError was caught: the fetch raised the others). A chunk is
    applied alone (`codec.apply`) or from its changed words decoded with others'
    (`codec.apply_words`): the one that raises is the `BAD`+1-th of either."""
    real, real_words, calls = codec.apply, codec.apply_words, [0]

    def fail_once() -> None:
        calls[0] += 1
        if calls[0] == BAD + 1:
            raise error

    def apply(dest: Parts, encoded: bytes | memoryview, encoding: str = ENCODING) -> None:
        fail_once()
        real(dest, encoded, encoding)

    def apply_words(dest: Sequence[memoryview], decoded: delta_words.Decoded) -> None:
        fail_once()
        real_words(dest, decoded)

    monkeypatch.setattr(codec, "apply", apply)
    monkeypatch.setattr(codec, "apply_words", apply_words)
    again, w2 = publish_and_read(connect, None, hostile)
    assert same(again.tensors, w2)
    assert again.delta is not None
    assert (again.delta.chunks, again.delta.whole_chunks) == (N - 1, 1), again.delta


@pytest.mark.parametrize("shape", list(HOSTILE))
def test_every_hostile_chunk_ends_the_reader_on_the_publishers_bytes(
    shape: str, connect: Callable[..., ros.Hub], hostile: Callable[[Make], None]
) -> None:
    """Corrupt, truncated, inflated, of another form, bomb-shaped, of no size: the chunk is
    read whole, every other one applied."""
    again, w2 = publish_and_read(connect, HOSTILE[shape], hostile)
    assert same(again.tensors, w2)
    assert again.delta is not None
    assert (again.delta.chunks, again.delta.whole_chunks) == (N - 1, 1), again.delta


# -- row 3: a companion that is not the size its version states ----------------------------

PAD = 16 << 20  # twice the model


@pytest.fixture
def resized(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """`resized(n)`: this process's publishers pad (n > 0) or cut (n < 0) each companion by
    n bytes, leaving v's manifest (its encoded sizes) as it was."""

    def install(by: int) -> None:
        real = BaseCopies._encode

        def encode(self: BaseCopies, model: str, base: Any, held: HeldVersion) -> Any:
            out = real(self, model, base, held)
            if out is None:
                return None
            blob = out.tensors[TENSOR]
            if by > 0:
                blob = torch.cat([blob, torch.zeros(by, dtype=torch.uint8)])
            else:
                blob = blob[:by].clone()
            return delta_publish.Encoded(out.section, {TENSOR: blob})

        monkeypatch.setattr(BaseCopies, "_encode", encode)

    return install


@pytest.mark.parametrize("by", [PAD, -100], ids=["padded", "cut"])
@pytest.mark.parametrize("behind", [1, 2], ids=["one link", "a chain"])
def test_row3_a_companion_of_another_size_is_not_read(
    by: int, behind: int, connect: Callable[..., ros.Hub], resized: Callable[[int], None]
) -> None:
    """A companion padded to 16 MiB (or cut short) for an 8 MiB version: the reader reads
    none of it (on 292ed20 it downloaded, kept and served the padded 16 MiB), and reads the
    version whole."""
    trainer, reader = connect(), connect()
    w = model(5)
    trainer.publish("policy", 1, w, chunk_size=CHUNK, delta=True)
    held = reader.fetch("policy", 1)
    held.release()
    resized(by)
    for v in range(2, 2 + behind):
        w = step(w, v)
        trainer.publish("policy", v, w, chunk_size=CHUNK, delta=True)
    last = 1 + behind
    again = reader.fetch("policy", last, into=held.tensors)
    assert same(again.tensors, w)
    assert again.delta is not None
    assert again.delta.chunks == 0, again.delta
    assert again.delta.encoded_bytes == 0, again.delta  # nothing of a companion crossed
    assert "DeltaRefused" in again.delta.fallback or "encodes" in again.delta.fallback
    assert again.stats.total_bytes == N * CHUNK  # the version, whole, and nothing more
    assert reader.delta_memory()["held_deltas"] == 0
    for v in range(2, 2 + behind):
        holders = {h.holder for h in trainer.holders(companion_of("policy"), v)}
        assert reader.holder_name not in holders


# -- row 4: a linear checksum, and a delta to other bytes of the same sum -------------------


def forged(payload: torch.Tensor) -> torch.Tensor:
    """Other bytes with the same wsum64: word 0 plus d, word 1 minus d * m0 / m1 (mod 2**64)."""
    out = payload.clone()
    words = out.numpy().view("<u8")
    m = [int(x) for x in multipliers_np(2)]
    d = 0x0101
    e = (-d * m[0] * pow(m[1], -1, 1 << 64)) % (1 << 64)
    words[0] = (int(words[0]) + d) % (1 << 64)
    words[1] = (int(words[1]) + e) % (1 << 64)
    assert wsum64_reference(bytes(out.numpy())) == wsum64_reference(bytes(payload.numpy()))
    assert not torch.equal(out, payload)
    return out


def forge(base: Parts, new: Parts, advance: bool) -> bytes | None:
    """Encode chunk `new` as other bytes with its wsum64 (the base copy brought to `new`)."""
    other = forged(codec.payload(new))
    encoded = codec.encode(base, [other])
    codec.encode(base, new, advance=advance)
    return encoded


def wsum_versions(
    connect: Callable[..., ros.Hub], make: Make | None, hostile: Callable[[Make], None]
) -> tuple[ros.Hub, ros.Hub, ros.Held, dict[str, torch.Tensor]]:
    """A trainer publishing under wsum64 with deltas; a reader that read policy@1 and then
    policy@2 (by `make`, None: honest) into the same memory."""
    trainer, reader = connect(), connect()
    w = model(6)
    trainer.publish("policy", 1, w, chunk_size=CHUNK, delta=True, checksum=WSUM64)
    held = reader.fetch("policy", 1)
    held.release()
    if make is not None:
        hostile(make)
    w2 = step(w, 7)
    trainer.publish("policy", 2, w2, chunk_size=CHUNK, delta=True, checksum=WSUM64)
    return trainer, reader, reader.fetch("policy", 2, into=held.tensors), w2


def test_row4_a_delta_to_other_bytes_of_the_same_weighted_sum_is_refused(
    connect: Callable[..., ros.Hub], hostile: Callable[[Make], None]
) -> None:
    """The delta of chunk `BAD` decodes to other bytes with the publisher's wsum64: the
    reader finds their xxh3-64 is not the one the delta section records, reads the chunk
    whole, and ends on the publisher's bytes (on 292ed20 it kept the forged ones, no error)."""
    _, _, again, w2 = wsum_versions(connect, forge, hostile)
    assert same(again.tensors, w2)
    assert again.delta is not None
    assert (again.delta.chunks, again.delta.whole_chunks) == (N - 1, 1), again.delta


def test_row4_a_publisher_that_records_the_forged_digest_splits_no_reader(
    connect: Callable[..., ros.Hub],
    hostile: Callable[[Make], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The publisher also records the forged chunk's xxh3-64, while it holds and serves the
    real one: delta readers end on the forged bytes, and a whole reader does too, or fails
    with an IntegrityError; it never accepts the bytes the delta readers do not hold."""
    real = delta_publish._result_digest

    def lie(copy: HeldVersion, held: HeldVersion, index: int) -> int:
        if index != BAD:
            return real(copy, held, index)
        return int(xxhash.xxh3_64_intdigest(forged(codec.payload(held.chunk_parts(BAD))).numpy()))

    monkeypatch.setattr(delta_publish, "_result_digest", lie)
    trainer, _, split, w2 = wsum_versions(connect, forge, hostile)
    assert split.delta is not None
    assert split.delta.chunks == N, split.delta  # the forged chunk passed: it is recorded
    assert not same(split.tensors, w2)
    try:
        got: ros.Held | None = connect().fetch("policy", 2, timeout=20)
    except IntegrityError:
        got = None  # the publisher's bytes refused, and the delta reader not reached: fine
    if got is not None:
        assert same(got.tensors, split.tensors)  # the forged bytes, as the delta reader holds
        got.release()
    split.release()  # the delta reader gone: the publisher's own bytes are all that is left
    assert trainer.holders("policy", 2)
    with pytest.raises(IntegrityError):
        connect().fetch("policy", 2, timeout=10)


def test_row4_an_honest_wsum64_delta_records_each_chunks_xxh3_and_applies(
    connect: Callable[..., ros.Hub],
) -> None:
    """The honest path: every chunk's xxh3-64 recorded, the delta applied to every chunk,
    and a whole reader, which checks both, reads the version too."""
    trainer, _, again, w2 = wsum_versions(connect, None, lambda _: None)
    assert same(again.tensors, w2)
    assert again.delta is not None
    assert again.delta.chunks == N, again.delta
    manifest = trainer._fetches.resolve("policy", 2, None, Deadline.after(30, "test")).manifest
    assert manifest.checksum == WSUM64
    assert list(manifest.delta.result_xxh3) == [
        xxhash.xxh3_64_intdigest(w2[f"w{i}"].view(torch.uint8).numpy()) for i in range(N)
    ]
    assert same(connect().fetch("policy", 2).tensors, w2)


# -- the fuzz: hostile chunks at the reader's chunk level ---------------------------------

FUZZ_CHUNK = 64 << 10


def _fuzz_setup() -> tuple[torch.Tensor, torch.Tensor, bytes]:
    g = torch.Generator().manual_seed(11)
    base = torch.randn(FUZZ_CHUNK // 2, generator=g).to(torch.bfloat16)
    mask = torch.rand(base.shape, generator=g) < 0.02
    new = torch.where(mask, (base.float() * 1.01).to(torch.bfloat16), base)
    encoded = codec.encode([base.view(torch.uint8)], [new.view(torch.uint8)])
    assert encoded is not None
    assert encoded[:1] == codec.WORDS
    return base.view(torch.uint8), new.view(torch.uint8), encoded


BASE, NEW, HONEST = _fuzz_setup()
SIZES = [0, 1, 6, FUZZ_CHUNK - 1, FUZZ_CHUNK, FUZZ_CHUNK + 1, 6 * FUZZ_CHUNK, 2 << 30, 1 << 40]


@st.composite
def hostile_chunks(draw: st.DrawFn) -> bytes:
    """An encoded chunk a hostile publisher may send: the honest one corrupted, truncated,
    inflated or given another form; a bomb-shaped frame of either form; or noise."""
    kind = draw(st.sampled_from(["flip", "truncate", "inflate", "form", "bomb", "noise"]))
    if kind == "flip":
        out = bytearray(HONEST)
        flips = st.tuples(st.integers(0, len(out) - 1), st.integers(1, 255))
        for at, x in draw(st.lists(flips, min_size=1, max_size=8)):
            out[at] ^= x
        return bytes(out)
    if kind == "truncate":
        return HONEST[: draw(st.integers(1, len(HONEST) - 1))]  # 0 bytes: a chunk sent whole
    if kind == "inflate":
        return HONEST + draw(st.binary(min_size=1, max_size=256))
    if kind == "form":
        return bytes([draw(st.integers(0, 255))]) + HONEST[1:]
    if kind == "noise":
        return draw(st.binary(min_size=1, max_size=2048))
    declared = draw(st.sampled_from([None, *SIZES]))
    content = draw(st.sampled_from([0, 1, 4096, FUZZ_CHUNK, 6 * FUZZ_CHUNK]))
    if declared is not None and declared <= 6 * FUZZ_CHUNK:
        content = declared  # a frame that holds what it declares
    body = frame(declared, content, byte=draw(st.integers(0, 255)))
    if draw(st.booleans()):
        return codec.DENSE + body
    count = draw(st.sampled_from([0, 1, 100, FUZZ_CHUNK // 8, FUZZ_CHUNK // 2, 1 << 31]))
    return codec.WORDS + words_head(FUZZ_CHUNK // 2, count) + body


@settings(
    max_examples=300, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip
@given(blob=hostile_chunks(), kind=st.sampled_from([XXH3, WSUM64]))
def test_fuzz_hostile_chunks_end_on_the_publishers_bytes_within_bounded_memory(
    blob: bytes, kind: str
) -> None:
    """The reader's own chunk path (`apply_one`) against a chunk a hostile publisher signed
    (its digest is the hostile bytes'): it never raises; it keeps the result only when it
    is the publisher's chunk, else the chunk is read whole (the publisher's bytes again);
    the codec under it raises only `IntegrityError`s (named); and the traced memory of the
    whole apply stays within the chunk's size plus 64 MiB."""
    layout = Layout.from_tensors({"w": BASE}, FUZZ_CHUNK)
    dest = HeldVersion.reader("t", "m", 2, layout, {"w": BASE.clone()})
    sums = [codec.chunk_checksum(_held(BASE, layout), 0, kind)]
    want = [codec.chunk_checksum(_held(NEW, layout), 0, kind)]
    section = pb.Delta(
        base=1, encoding=ENCODING, encoded_bytes=[len(blob)],
        encoded_xxh3=[codec.digest(blob)], base_checksum=sums, companion="m.delta",
    )  # fmt: skip
    if kind == WSUM64:  # the publisher's xxh3-64 of its chunk, under a linear checksum
        section.result_xxh3.append(xxhash.xxh3_64_intdigest(NEW.numpy()))
    manifest = pb.Manifest(
        chunk_size=FUZZ_CHUNK, chunk_xxh3=want, checksum="" if kind == XXH3 else kind,
        delta=section,
    )  # fmt: skip
    blobs = [Encoded(section, {TENSOR: torch.frombuffer(bytearray(blob), dtype=torch.uint8)})]
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        applied = apply_one([Link(2, manifest)], blobs, dest, 0, kind)
        with contextlib.suppress(IntegrityError):  # named: any other exception fails the test
            codec.apply([BASE.clone()], blob)
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    assert peak < FUZZ_CHUNK + SLACK, f"{peak >> 20} MiB"
    if applied:
        assert torch.equal(dest.tensors["w"], NEW)
        assert dest.is_present(0)
    else:
        assert not dest.is_present(0)  # left to be read whole: the publisher's bytes


@settings(
    max_examples=150, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip
@given(blob=hostile_chunks(), kind=st.sampled_from([XXH3, WSUM64]))
def test_fuzz_a_hostile_chunk_decoded_with_honest_ones_fails_alone(blob: bytes, kind: str) -> None:
    """The reader's path for chunks applied together (`apply_many`: their changed words
    decoded at once) against the same hostile chunks, between two honest ones: it never
    raises; the honest chunks end on the publisher's bytes; the hostile one is applied
    exactly when `apply_one` applies it alone, and ends on the publisher's chunk, or on the
    base and missing (to be read whole); all within the same memory bound."""
    layout = Layout.from_tensors({"w": torch.cat([BASE] * 3)}, FUZZ_CHUNK)
    dest = HeldVersion.reader("t", "m", 2, layout, {"w": torch.cat([BASE] * 3)})
    blobs = [HONEST, blob, HONEST]
    single = Layout.from_tensors({"w": BASE}, FUZZ_CHUNK)
    sums = [codec.chunk_checksum(_held(BASE, single), 0, kind)] * 3
    want = [codec.chunk_checksum(_held(NEW, single), 0, kind)] * 3
    section = pb.Delta(
        base=1, encoding=ENCODING, encoded_bytes=[len(b) for b in blobs],
        encoded_xxh3=[codec.digest(b) for b in blobs], base_checksum=sums, companion="m.delta",
    )  # fmt: skip
    if kind == WSUM64:
        section.result_xxh3.extend([xxhash.xxh3_64_intdigest(NEW.numpy())] * 3)
    manifest = pb.Manifest(
        chunk_size=FUZZ_CHUNK, chunk_xxh3=want, checksum="" if kind == XXH3 else kind,
        delta=section,
    )  # fmt: skip
    joined = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
    encoded = [Encoded(section, {TENSOR: joined})]
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        made = apply_many([Link(2, manifest)], encoded, dest, [0, 1, 2], kind)
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    assert peak < FUZZ_CHUNK + SLACK, f"{peak >> 20} MiB"
    chunks = dest.tensors["w"].view(torch.uint8).reshape(3, -1)
    for i in (0, 2):
        assert dest.is_present(i)
        assert torch.equal(chunks[i], NEW)
    applied = dest.is_present(1)
    assert made == 2 + applied
    assert torch.equal(chunks[1], NEW if applied else BASE)
    alone = HeldVersion.reader("t", "m", 2, layout, {"w": torch.cat([BASE] * 3)})
    assert apply_one([Link(2, manifest)], encoded, alone, 1, kind) == applied


def _held(data: torch.Tensor, layout: Layout) -> HeldVersion:
    return HeldVersion.publisher("t", "m", 1, {"w": data}, layout)


def test_the_fuzzed_chunk_applies_when_honest() -> None:
    """The fuzz's flips and cuts are of an encoding that applies (its end-to-end shapes are
    `test_every_hostile_chunk_ends_the_reader_on_the_publishers_bytes`)."""
    dest = BASE.clone()
    codec.apply([dest], HONEST)
    assert torch.equal(dest, NEW)
    assert np.count_nonzero(BASE.numpy() != NEW.numpy()) > 0
