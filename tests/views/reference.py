"""A second quantizer for both view formats, written from docs/views.md alone in numpy: it
never calls `ros.views`, nor torch's float8 casts.

Inputs are float32 arrays (the weights as the document's step 1 makes them); outputs are
the raw bytes: e4m3 codes as uint8, `fp8-block128` scales as float32, `mxfp8` scales as
uint8 biased exponents.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

E4M3_MAX = 448.0
BLOCK = 128
MX_BLOCK = 32

U8 = NDArray[np.uint8]
F32 = NDArray[np.float32]


def e4m3_code(y: NDArray[np.floating]) -> U8:
    """The e4m3 code of each y (|y| <= 448): the nearest value, ties to the even code;
    below 2^-6 the nearest multiple of 2^-9, in [2^k, 2^(k+1)) of 2^(k-3); the sign bit
    is y's sign (a negative y that rounds to zero is 0x80)."""
    y64 = np.asarray(y, dtype=np.float64)
    if np.any(np.abs(y64) > E4M3_MAX) or not np.all(np.isfinite(y64)):
        raise ValueError("e4m3_code takes finite values within [-448, 448]")
    a = np.abs(y64)
    code = np.zeros(a.shape, dtype=np.int64)
    sub = a < 2.0**-6
    code[sub] = np.rint(a[sub] * 2.0**9).astype(np.int64)  # 0..8; 8 is 2^-6, code 0x08
    normal = ~sub
    _, e = np.frexp(a[normal])  # a = m 2^e, m in [0.5, 1): a in [2^(e-1), 2^e)
    k = e.astype(np.int64) - 1
    steps = np.rint(a[normal] / np.ldexp(1.0, k - 3)).astype(np.int64)  # 8..16
    carry = steps == 16
    k = k + carry
    steps = np.where(carry, 8, steps)
    code[normal] = ((k + 7) << 3) | (steps - 8)
    sign = np.signbit(y64).astype(np.int64) << 7
    return (code | sign).astype(np.uint8)


def e4m3_value(code: U8) -> NDArray[np.float64]:
    """The value of each e4m3 code (NaN for 0x7F and 0xFF)."""
    c = np.asarray(code, dtype=np.int64)
    s = np.where(c & 0x80, -1.0, 1.0)
    e, m = (c >> 3) & 0xF, c & 0x7
    normal = s * np.ldexp(1.0 + m / 8.0, e - 7)
    value = np.where(e == 0, s * m * 2.0**-9, normal)
    return np.where((e == 15) & (m == 7), np.nan, value)


def quantize_fp8_block128(x: F32) -> tuple[U8, F32]:
    """Per 128x128 block: a = max(amax, fp32(1e-4)); s = fl32(a / 448);
    q = e4m3(clamp(fl32(x / s), -448, 448))."""
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    nb_r, nb_c = -(-rows // BLOCK), -(-cols // BLOCK)
    codes = np.zeros((rows, cols), dtype=np.uint8)
    scale = np.zeros((nb_r, nb_c), dtype=np.float32)
    for i in range(nb_r):
        for j in range(nb_c):
            rs, cs = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            block = x[rs, cs]
            amax = np.float32(np.abs(block).max())
            a = max(amax, np.float32(1e-4))
            s = np.float32(a) / np.float32(E4M3_MAX)
            y = np.clip(block / s, np.float32(-E4M3_MAX), np.float32(E4M3_MAX))
            assert y.dtype == np.float32
            assert isinstance(s, np.float32)
            codes[rs, cs] = e4m3_code(y)
            scale[i, j] = s
    return codes, scale


def dequantize_fp8_block128(codes: U8, scale: F32) -> F32:
    """x' = fl32(q x s) with each element's block scale."""
    rows, cols = codes.shape
    s = np.repeat(np.repeat(scale, BLOCK, axis=0), BLOCK, axis=1)[:rows, :cols]
    return (e4m3_value(codes).astype(np.float32) * s).astype(np.float32)


def quantize_mxfp8(x: F32) -> tuple[U8, U8]:
    """Per 32 consecutive elements of a row: E = floor(log2 amax) - 8 read from amax's
    fp32 exponent bits, clamped at -127 (and -127 for a zero or fp32-subnormal amax, whose
    floor(log2) is below -126); b = E + 127; q = e4m3(clamp(x 2^-E, -448, 448))."""
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    nb = -(-cols // MX_BLOCK)
    codes = np.zeros((rows, cols), dtype=np.uint8)
    scale = np.zeros((rows, nb), dtype=np.uint8)
    for j in range(nb):
        cs = slice(j * MX_BLOCK, (j + 1) * MX_BLOCK)
        block = x[:, cs]
        amax = np.abs(block).max(axis=1).astype(np.float32)
        field = ((amax.view(np.uint32) >> 23) & 0xFF).astype(np.int64)
        shared = np.where(field == 0, -127, np.maximum(field - 127 - 8, -127))
        scale[:, j] = (shared + 127).astype(np.uint8)
        y = block.astype(np.float64) * np.ldexp(1.0, -shared)[:, None]  # exact
        codes[:, cs] = e4m3_code(np.clip(y, -E4M3_MAX, E4M3_MAX))
    return codes, scale


def dequantize_mxfp8(codes: U8, scale: U8) -> F32:
    """x' = q x 2^(b - 127), exact."""
    cols = codes.shape[1]
    factor = np.ldexp(1.0, scale.astype(np.int64) - 127)
    full: NDArray[np.float64] = np.repeat(factor, MX_BLOCK, axis=1)[:, :cols]
    out: F32 = (e4m3_value(codes) * full).astype(np.float32)
    return out
