"""wsum64, the chunk checksum a GPU computes where the tensors are (transport/checksums.py):
its torch kernels (run here on CPU tensors: the same code a CUDA tensor runs) against the
formula in plain numpy, what it detects, and a reader verifying it end to end."""

from __future__ import annotations

import random
import time
from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.errors import IntegrityError, InvalidManifest
from tests.transport._model import MODEL, TENANT, make_model
from tests.transport.conftest import StartHolder
from transport.checksums import (
    WSUM64,
    XXH3,
    kind_of,
    multipliers_np,
    wsum64,
    wsum64_of_views,
    wsum64_reference,
)
from transport.layout import Layout
from transport.reader import fetch
from transport.store import HeldVersion
from transport.topology import Topology

CHUNK = 64 * 1024


def _tensor(data: bytes) -> torch.Tensor:
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=4096))
def test_the_torch_kernels_compute_the_formula(data: bytes) -> None:
    assert wsum64(_tensor(data)) == wsum64_reference(data)
    assert wsum64_of_views([memoryview(data)]) == wsum64_reference(data)


def test_lengths_alignment_and_a_chunk_split_across_views() -> None:
    rng = random.Random(7)
    for n in (0, 1, 7, 8, 9, 4099, CHUNK, 4 << 20):
        data = rng.randbytes(n)
        assert wsum64(_tensor(data)) == wsum64_reference(data), n
    data = rng.randbytes(10_003)
    unaligned = _tensor(b"x" + data)[1:]  # storage offset 1: not an int64 boundary
    assert wsum64(unaligned) == wsum64_reference(data)
    views = [memoryview(data[:3]), memoryview(data[3:5000]), memoryview(data[5000:])]
    assert wsum64_of_views(views) == wsum64_reference(data)


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=1, max_size=4096), st.data())
def test_the_sum_is_linear_so_parts_split_inside_a_word_add_up(
    data: bytes, draw: st.DataObject
) -> None:
    """What publish-time checksums of declared layouts rest on (docs/design-notes.md,
    "Publish-time checksums of declared layouts"): the bytes of a chunk split between
    holders at any byte, each part summed with the others' bytes zeroed, add up modulo
    2**64 to the chunk's sum, a word that straddles a cut included."""
    cuts = sorted([min(5, len(data)), *draw.draw(st.lists(st.integers(0, len(data)), max_size=3))])
    edges = [0, *cuts, len(data)]
    parts = [bytes(a) + data[a:b] + bytes(len(data) - b) for a, b in pairwise(edges)]
    assert all(len(p) == len(data) for p in parts)
    total = sum(wsum64_reference(p) for p in parts) % (1 << 64)
    assert total == wsum64_reference(data)


def test_every_multiplier_is_odd_so_any_one_word_change_is_caught() -> None:
    assert all(int(m) & 1 for m in multipliers_np(1 << 16))
    rng = random.Random(3)
    data = bytearray(rng.randbytes(512))
    good = wsum64_reference(bytes(data))
    for position in range(len(data)):
        for bit in (0, 3, 7):
            data[position] ^= 1 << bit
            assert wsum64_reference(bytes(data)) != good, (position, bit)
            data[position] ^= 1 << bit


def test_swapped_words_zeroed_and_stale_regions_are_caught() -> None:
    rng = random.Random(5)
    data = rng.randbytes(CHUNK)
    good = wsum64(_tensor(data))
    swapped = data[8:16] + data[:8] + data[16:]
    zeroed = data[:4096] + bytes(4096) + data[8192:]
    stale = data[:1000] + rng.randbytes(3000) + data[4000:]
    for changed in (swapped, zeroed, stale):
        assert wsum64(_tensor(changed)) != good


def test_a_manifest_names_its_algorithm() -> None:
    assert kind_of("") == XXH3  # every manifest written before the field
    assert kind_of(WSUM64) == WSUM64
    with pytest.raises(InvalidManifest, match="unknown chunk checksum"):
        kind_of("crc32")


def test_a_holders_chunk_sums_cover_chunks_that_span_tensors() -> None:
    """`HeldVersion.wsum64` (torch where the tensors are: here the CPU) over chunks that
    pack many small tensors equals the formula over the chunk's bytes as served."""
    model = make_model(2, tiny=200)
    layout = Layout.from_tensors(model, chunk_size=CHUNK)
    held = HeldVersion.publisher(TENANT, MODEL, 1, model, layout)
    spans = [len(held.segments(i)) for i in range(layout.num_chunks)]
    assert max(spans) > 1  # some chunk holds several tensors
    for i in range(layout.num_chunks):
        served = b"".join(bytes(v) for v in held.source_views(i))
        assert held.wsum64(i) == wsum64_reference(served)


def test_a_reader_verifies_wsum64_and_catches_a_holder_whose_memory_drifted(
    holders: StartHolder,
) -> None:
    model = make_model(5, tiny=50)
    layout = Layout.from_tensors(model, chunk_size=CHUNK)
    published = HeldVersion.publisher(TENANT, MODEL, 1, model, layout)
    expected = [published.wsum64(i) for i in range(layout.num_chunks)]
    drifted = {k: v + 1 for k, v in model.items()}  # its own xxh3s stay consistent
    bad = holders(drifted, layout, name="drifted")[2]
    good = holders(model, layout, name="good")[2]

    def read(sources: list, kind: str) -> HeldVersion:  # type: ignore[type-arg]
        dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate())
        fetch(
            TENANT, MODEL, 1, layout, dest, sources, token=b"t",
            deadline=time.monotonic() + 20, me=Topology(), expected=expected, checksum=kind,
        )  # fmt: skip
        return dest

    dest = read([good], WSUM64)
    assert all(torch.equal(dest.tensors[k], model[k]) for k in model)
    with pytest.raises(IntegrityError, match="differs from the published version"):
        read([bad], WSUM64)
    # read as if they were xxh3 sums, the same values match nothing: the kind matters
    with pytest.raises(IntegrityError, match="differs from the published version"):
        read([good], XXH3)
