"""Properties of both view formats on generated weights (hypothesis): the reference's bytes
and the document's error bound whatever the shape and magnitude; mxfp8 is a fixed point of
its own dequantization; and a weight cut at block boundaries quantizes, part by part, to
the bytes of the whole (what a rank quantizing its own rows or columns relies on)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ros.views import formats
from tests.views import reference as ref
from tests.views.test_formats import (
    check_block128,
    check_mxfp8,
    within_block128_bound,
    within_mxfp8_bound,
)

dims = st.integers(min_value=1, max_value=260)
exponents = st.integers(min_value=-130, max_value=120)


@st.composite
def weights(draw: st.DrawFn) -> torch.Tensor:
    """A bf16 weight: normal values times 2^k per row band (k anywhere bf16 reaches), some
    exact zeros, some blocks zeroed whole."""
    rows, cols = draw(dims), draw(dims)
    seed = draw(st.integers(min_value=0, max_value=2**32 - 1))
    gen = np.random.default_rng(seed)
    x = gen.standard_normal((rows, cols))
    scales = np.ldexp(1.0, np.array(draw(st.lists(exponents, min_size=1, max_size=4))))
    x *= np.resize(scales, rows)[:, None]
    x[gen.random((rows, cols)) < draw(st.floats(0, 0.5))] = 0.0
    if draw(st.booleans()):
        r, c = gen.integers(0, rows), gen.integers(0, cols)
        x[r : r + 128, c : c + 64] = 0.0
    x = np.clip(x, -3e38, 3e38)
    return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)


@settings(max_examples=30, deadline=None)
@given(weights())
def test_fp8_block128_matches_the_reference_within_its_bound(w: torch.Tensor) -> None:
    q, s = check_block128(w)
    within_block128_bound(w, q, s)


@settings(max_examples=30, deadline=None)
@given(weights())
def test_mxfp8_matches_the_reference_within_its_bound(w: torch.Tensor) -> None:
    q, e = check_mxfp8(w)
    within_mxfp8_bound(w, q, e)


@settings(max_examples=25, deadline=None)
@given(weights())
def test_mxfp8_is_a_fixed_point_of_its_dequantization(w: torch.Tensor) -> None:
    """Each block's largest code lies in [256, 448] x X unless the exponent was clamped at
    -127, so requantizing x' finds the same exponent and codes (docs/views.md)."""
    q, e = formats.quantize_mxfp8(w)
    q2, e2 = formats.quantize_mxfp8(formats.dequantize_mxfp8(q, e))
    assert torch.equal(e2, e)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


@settings(max_examples=20, deadline=None)
@given(weights(), st.data())
def test_parts_cut_at_block_boundaries_quantize_as_the_whole(
    w: torch.Tensor, data: st.DataObject
) -> None:
    rows, cols = w.shape
    cut_r = data.draw(st.integers(0, rows // 128)) * 128
    cut_c = data.draw(st.integers(0, cols // 128)) * 128
    q, s = formats.quantize_fp8_block128(w)
    for r0, r1 in ((0, cut_r), (cut_r, rows)):
        for c0, c1 in ((0, cut_c), (cut_c, cols)):
            if r0 == r1 or c0 == c1:
                continue
            qp, sp = formats.quantize_fp8_block128(w[r0:r1, c0:c1])
            assert torch.equal(qp.view(torch.uint8), q[r0:r1, c0:c1].view(torch.uint8))
            assert torch.equal(sp, s[r0 // 128 : -(-r1 // 128), c0 // 128 : -(-c1 // 128)])
    cut_r = data.draw(st.integers(0, rows))
    cut_c = data.draw(st.integers(0, cols // 32)) * 32
    q, e = formats.quantize_mxfp8(w)
    for r0, r1 in ((0, cut_r), (cut_r, rows)):
        for c0, c1 in ((0, cut_c), (cut_c, cols)):
            if r0 == r1 or c0 == c1:
                continue
            qp, ep = formats.quantize_mxfp8(w[r0:r1, c0:c1])
            assert torch.equal(qp.view(torch.uint8), q[r0:r1, c0:c1].view(torch.uint8))
            assert torch.equal(ep, e[r0:r1, c0 // 32 : -(-c1 // 32)])


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=-448, max_value=448, allow_nan=False, width=32))
def test_torch_e4m3_cast_is_the_documented_rounding(y: float) -> None:
    """The one rounding both formats end with: torch's cast of a clamped fp32 value is the
    document's e4m3_rne (ties to even, sign kept), including subnormals and -0."""
    t = torch.tensor([y], dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)
    assert int(t[0]) == int(ref.e4m3_code(np.array([y], dtype=np.float32))[0])
