"""Both view formats against the reference quantizer written from docs/views.md
(`tests/views/reference.py`): the same bytes, the error bound the document derives, and the
refusals it names."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from ros.views import formats
from tensorhub.errors import InvalidArgument
from tests.views import reference as ref
from tests.views.weights import SHAPES, awkward, random_bf16

Quantize = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def codes(q: torch.Tensor) -> np.ndarray:
    return q.view(torch.uint8).numpy()


def bits(x: torch.Tensor | np.ndarray) -> np.ndarray:
    arr = x.numpy() if isinstance(x, torch.Tensor) else x
    return arr.astype(np.float32).view(np.uint32)


def check_block128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and scale_inv equal the reference's bit for bit; returns them."""
    q, s = formats.quantize_fp8_block128(w)
    want_q, want_s = ref.quantize_fp8_block128(w.float().numpy())
    assert q.dtype == torch.float8_e4m3fn
    assert s.dtype == torch.float32
    assert q.shape == w.shape
    assert s.shape == want_s.shape
    np.testing.assert_array_equal(bits(s), bits(want_s))
    np.testing.assert_array_equal(codes(q), want_q)
    return q, s


def check_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, e = formats.quantize_mxfp8(w)
    want_q, want_e = ref.quantize_mxfp8(w.float().numpy())
    assert q.dtype == torch.float8_e4m3fn
    assert e.dtype == torch.uint8
    assert q.shape == w.shape
    assert e.shape == want_e.shape
    np.testing.assert_array_equal(e.numpy(), want_e)
    np.testing.assert_array_equal(codes(q), want_q)
    return q, e


def within_block128_bound(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """|x' - x| <= 2^-4 |x| + 2^-10 s (docs/views.md), with 2^-20 relative slack for the
    fp32 roundings of s, x / s and q x s."""
    x = w.float().numpy().astype(np.float64)
    back = formats.dequantize_fp8_block128(q, s).numpy().astype(np.float64)
    np.testing.assert_array_equal(
        bits(back), bits(ref.dequantize_fp8_block128(codes(q), s.numpy()))
    )
    rows, cols = x.shape
    s_full = np.repeat(np.repeat(s.numpy(), 128, 0), 128, 1)[:rows, :cols].astype(np.float64)
    bound = (2.0**-4 * np.abs(x) + 2.0**-10 * s_full) * (1 + 2.0**-20)
    assert np.all(np.abs(back - x) <= bound)


def within_mxfp8_bound(w: torch.Tensor, q: torch.Tensor, e: torch.Tensor) -> None:
    """|x' - x| <= 2^-3 |x| + 2^-10 X, and 2^-4 |x| + 2^-10 X where |x| <= 448 X; x' exact."""
    x = w.float().numpy().astype(np.float64)
    back = formats.dequantize_mxfp8(q, e).numpy().astype(np.float64)
    np.testing.assert_array_equal(bits(back), bits(ref.dequantize_mxfp8(codes(q), e.numpy())))
    cols = x.shape[1]
    big_x = np.repeat(np.ldexp(1.0, e.numpy().astype(np.int64) - 127), 32, 1)[:, :cols]
    err = np.abs(back - x)
    assert np.all(err <= 2.0**-3 * np.abs(x) + 2.0**-10 * big_x)
    unsaturated = np.abs(x) <= 448 * big_x
    assert np.all(err[unsaturated] <= (2.0**-4 * np.abs(x) + 2.0**-10 * big_x)[unsaturated])


def test_e4m3_codes_are_the_definition() -> None:
    """All 256 codes: torch's float8_e4m3fn reads each as the document's formula says, and
    the reference encodes every finite value back to its own code."""
    every = np.arange(256, dtype=np.uint8)
    as_torch = torch.from_numpy(every).view(torch.float8_e4m3fn).float().numpy()
    want = ref.e4m3_value(every)
    np.testing.assert_array_equal(np.isnan(as_torch), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(as_torch[finite], want[finite])
    assert want[0x7E] == 448.0
    assert want[0x08] == 2.0**-6
    assert want[0x01] == 2.0**-9
    np.testing.assert_array_equal(ref.e4m3_code(want[finite]), every[finite])
    # Ties go to the even code: 1.0625 between 1 (m=0) and 1.125 (m=1), 1.1875 to 1.25.
    np.testing.assert_array_equal(ref.e4m3_value(ref.e4m3_code(np.array([1.0625, 1.1875]))),
                                  [1.0, 1.25])  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_block128_is_the_reference_bit_for_bit(shape: tuple[int, int]) -> None:
    w = awkward(*shape, seed=sum(shape))
    q, s = check_block128(w)
    within_block128_bound(w, q, s)


@pytest.mark.parametrize("shape", SHAPES)
def test_mxfp8_is_the_reference_bit_for_bit(shape: tuple[int, int]) -> None:
    w = awkward(*shape, seed=sum(shape))
    q, e = check_mxfp8(w)
    within_mxfp8_bound(w, q, e)


def test_a_large_ordinary_weight_is_the_reference_bit_for_bit() -> None:
    """1024x1024 normal weights: enough elements that a quantizer multiplying by a rounded
    1/s instead of dividing by s (vLLM's `per_block_cast_to_fp8`) differs somewhere."""
    w = random_bf16(1024, 1024, seed=11)
    q, s = check_block128(w)
    check_mxfp8(w)
    x = w.float()
    s_full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    by_reciprocal = (x * (1.0 / s_full)).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert (codes(by_reciprocal) != codes(q)).any()  # so the equality above can tell


def test_all_zero_blocks() -> None:
    """fp8-block128: scale fl32(fp32(1e-4) / 448), codes +0; mxfp8: byte 0 (2^-127)."""
    w = torch.zeros(130, 70, dtype=torch.bfloat16)
    w[129, 69] = -0.0
    q, s = check_block128(w)
    assert np.all(bits(s) == bits(np.array([1e-4], np.float32) / np.float32(448)))
    assert set(np.unique(codes(q))) <= {0x00, 0x80}
    q, e = check_mxfp8(w)
    assert np.all(e.numpy() == 0)
    assert set(np.unique(codes(q))) <= {0x00, 0x80}
    assert not formats.dequantize_mxfp8(q, e).any()


def test_saturation_in_mxfp8() -> None:
    """amax 1.9921875 x 2^k: shared exponent k - 8, amax / X = 510 > 448, coded 448."""
    w = torch.tensor([[1.9921875 * 2.0**-3] + [0.001] * 31], dtype=torch.bfloat16)
    q, e = check_mxfp8(w)
    assert int(e[0, 0]) == 127 - 3 - 8
    assert codes(q)[0, 0] == 0x7E  # 448
    within_mxfp8_bound(w, q, e)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_float_inputs(dtype: torch.dtype) -> None:
    w = awkward(131, 97, seed=5).float().clamp(-6e4, 6e4).to(dtype)  # fp16's range
    if dtype == torch.float32:
        w = w + torch.randn(w.shape) * 1e-3 * w.abs()  # values bf16 cannot hold
    check_block128(w)
    check_mxfp8(w)


def test_chunking_and_layout_do_not_change_the_bytes() -> None:
    w = awkward(300, 200, seed=9)
    for fn in (formats.quantize_fp8_block128, formats.quantize_mxfp8):
        q, s = fn(w)
        for chunk in (1, 1000, 50_000):
            q2, s2 = fn(w, chunk_elements=chunk)
            assert torch.equal(codes_t(q2), codes_t(q))
            assert torch.equal(s2, s)
        t = w.t().contiguous().t()  # the same values, column-major
        q3, s3 = fn(t)
        assert torch.equal(codes_t(q3), codes_t(q))
        assert torch.equal(s3, s)


def codes_t(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(
    "fn", [formats.quantize_fp8_block128, formats.quantize_mxfp8], ids=["block128", "mxfp8"]
)
def test_non_finite_weights_are_refused(bad: float, fn: Quantize) -> None:
    w = random_bf16(200, 300, seed=1)
    w[150, 250] = bad
    with pytest.raises(InvalidArgument, match=r"layer\.weight\[150, 250\] is (nan|inf|-inf)"):
        fn(w, name="layer.weight", chunk_elements=4096)


def test_bad_inputs_are_refused() -> None:
    for fn in (formats.quantize_fp8_block128, formats.quantize_mxfp8):
        with pytest.raises(InvalidArgument, match="2-D"):
            fn(torch.zeros(4, 4, 4))
        with pytest.raises(InvalidArgument, match="int32"):
            fn(torch.zeros(4, 4, dtype=torch.int32))
    q = torch.zeros(4, 40, dtype=torch.float8_e4m3fn)
    with pytest.raises(InvalidArgument, match="scale_inv"):
        formats.dequantize_fp8_block128(q, torch.ones(1, 2))
    with pytest.raises(InvalidArgument, match="scale"):
        formats.dequantize_mxfp8(q, torch.ones(4, 1, dtype=torch.uint8))
    with pytest.raises(InvalidArgument, match="NaN"):
        formats.dequantize_mxfp8(q, torch.full((4, 2), 255, dtype=torch.uint8))
    scale = torch.full((4, 2), 127, dtype=torch.uint8)
    assert torch.equal(
        formats.dequantize_mxfp8(q, scale.view(torch.float8_e8m0fnu)),
        formats.dequantize_mxfp8(q, scale),
    )
