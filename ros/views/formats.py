"""The arithmetic of the two view formats (docs/views.md): a 2-D weight into e4m3 elements
and their scales, and back.

- `fp8-block128` (DeepSeek-V3's FP8 checkpoints, vLLM's `Fp8Config` with
  `weight_block_size`): one fp32 `weight_scale_inv` s per 128x128 block,
  s = max(amax, 1e-4) / 448, q = e4m3(x / s); x ~ q * s.
- `mxfp8` (OCP Microscaling Formats v1.0, as vLLM's ModelOpt MXFP8 checkpoints store it):
  one e8m0 scale (a uint8 biased exponent) per 32 consecutive elements of a row,
  X = 2^(floor(log2 amax) - 8), q = e4m3(saturate(x / X)); x ~ q * X.

Torch operations only, on the weight's own device, so a GPU runs this same code and gets the
same bits: every step is exact or one correctly rounded fp32 operation (a true division,
never a multiplication by a rounded reciprocal; powers of two are built from their bits).
A weight is quantized a chunk of rows at a time (about `CHUNK_ELEMENTS` elements on a CPU,
`CHUNK_ELEMENTS_GPU` on a GPU), copied into one fp32 buffer and scaled there in place: beyond
its input, quantizing holds its output (one byte an element, plus the scales) and that
buffer, whatever the weight's size.
"""

from __future__ import annotations

import torch

from tensorhub.errors import InvalidArgument

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3 value, 1.75 x 2^8
BLOCK = 128  # fp8-block128: a block is BLOCK x BLOCK elements
AMAX_FLOOR = 1e-4  # fp8-block128: a block's amax is taken as at least this (both references)
MX_BLOCK = 32  # mxfp8: a block is MX_BLOCK consecutive elements of one row
MX_EMAX_ELEM = 8  # mxfp8: the exponent of e4m3's largest normal (448 = 1.75 x 2^8)
E8M0_BIAS = 127  # mxfp8: a scale byte b stands for 2^(b - 127)
MX_MIN_EXP = -127  # mxfp8: the smallest shared exponent an e8m0 byte holds (byte 0)
CHUNK_ELEMENTS = 1 << 18  # elements quantized at once on a CPU: a 1 MiB fp32 buffer
CHUNK_ELEMENTS_GPU = 1 << 24  # on a GPU, where a kernel launch costs more than 64 MiB does
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # each exact in fp32


def default_chunk(device: torch.device) -> int:
    """Elements per chunk on `device` (module docstring)."""
    return CHUNK_ELEMENTS if device.type == "cpu" else CHUNK_ELEMENTS_GPU


def quantize_fp8_block128(
    w: torch.Tensor, *, name: str = "weight", chunk_elements: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` (rows x cols) as e4m3 `q` of the same shape and fp32 `scale_inv` of
    ceil(rows/128) x ceil(cols/128), on `w`'s device; `w ~ q * scale_inv` blockwise.

    Per block (a partial edge block is its real elements: zero padding changes no amax):
    s = fl32(max(amax, 1e-4) / 448), q = e4m3_rne(clamp(fl32(x / s), -448, 448)).
    `InvalidArgument` for a weight that is not 2-D bf16/fp16/fp32, or that holds a NaN or an
    infinity (named by `name` and the element's index)."""
    rows, cols = _check(w, name)
    q = torch.empty((rows, cols), dtype=E4M3, device=w.device)
    scale_inv = torch.empty((_ceil(rows, BLOCK), _ceil(cols, BLOCK)), dtype=torch.float32,
                            device=w.device)  # fmt: skip
    # A tensor divisor, not a Python number: CUDA turns a division by a scalar into a
    # multiplication by its rounded reciprocal, which can differ in the last bit.
    e4m3_max = torch.tensor(E4M3_MAX, dtype=torch.float32, device=w.device)
    step = _rows_per_chunk(cols, BLOCK, chunk_elements or default_chunk(w.device))
    chunk = _Chunk(w, step, BLOCK, BLOCK)
    for r0 in range(0, rows, step):
        x, n = chunk.load(r0)
        blocks = x.view(x.shape[0] // BLOCK, BLOCK, x.shape[1] // BLOCK, BLOCK)
        amax = _amax(blocks, (1, 3))
        _refuse_non_finite(amax, w, name, r0, n)
        s = amax.clamp(min=AMAX_FLOOR) / e4m3_max
        torch.div(blocks, s[:, None, :, None], out=blocks).clamp_(-E4M3_MAX, E4M3_MAX)
        q[r0 : r0 + n].copy_(x[:n, :cols])  # the one rounding, to e4m3
        scale_inv[r0 // BLOCK : r0 // BLOCK + s.shape[0]] = s
    return q, scale_inv


def dequantize_fp8_block128(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    chunk_elements: int | None = None,
) -> torch.Tensor:
    """x' = fl32(q * s) for each element and its block's s, cast to `dtype` (DeepSeek-V3's
    `weight_dequant`). `InvalidArgument` if `q` is not 2-D e4m3 or `scale_inv` is not the
    fp32 ceil(rows/128) x ceil(cols/128) of it."""
    rows, cols = _check_quantized(q, "q")
    want = (_ceil(rows, BLOCK), _ceil(cols, BLOCK))
    if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != want:
        raise InvalidArgument(
            f"scale_inv is {scale_inv.dtype} {list(scale_inv.shape)}: a {rows}x{cols} "
            f"fp8-block128 weight has float32 {list(want)}"
        )
    out = torch.empty((rows, cols), dtype=dtype, device=q.device)
    step = _rows_per_chunk(cols, BLOCK, chunk_elements or default_chunk(q.device))
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        s = scale_inv[r0 // BLOCK : _ceil(r1, BLOCK)]
        s_full = s.repeat_interleave(BLOCK, 0)[: r1 - r0].repeat_interleave(BLOCK, 1)[:, :cols]
        out[r0:r1] = (q[r0:r1].to(torch.float32) * s_full).to(dtype)
    return out


def quantize_mxfp8(
    w: torch.Tensor, *, name: str = "weight", chunk_elements: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` (rows x cols) as e4m3 `q` of the same shape and uint8 e8m0 `scale` of
    rows x ceil(cols/32), on `w`'s device; `w ~ q * 2^(scale - 127)` per 32 elements.

    Per block of 32 consecutive elements of a row (a partial last block is its real
    elements): E = max(floor(log2 amax) - 8, -127), or -127 for an all-zero block;
    scale = E + 127; q = e4m3_rne(clamp(x * 2^-E, -448, 448)) (exact scaling, then one
    rounding). `InvalidArgument` as `quantize_fp8_block128`."""
    rows, cols = _check(w, name)
    nb = _ceil(cols, MX_BLOCK)
    q = torch.empty((rows, cols), dtype=E4M3, device=w.device)
    scale = torch.empty((rows, nb), dtype=torch.uint8, device=w.device)
    step = _rows_per_chunk(cols, 1, chunk_elements or default_chunk(w.device))
    chunk = _Chunk(w, step, 1, MX_BLOCK)
    for r0 in range(0, rows, step):
        x, n = chunk.load(r0)
        blocks = x.view(n, nb, MX_BLOCK)
        amax = _amax(blocks, (2,))
        _refuse_non_finite(amax, w, name, r0, n)
        shared = shared_exponent(amax)
        blocks.mul_(pow2(-shared)[..., None]).clamp_(-E4M3_MAX, E4M3_MAX)
        q[r0 : r0 + n].copy_(x[:, :cols])  # the one rounding, to e4m3
        scale[r0 : r0 + n] = (shared + E8M0_BIAS).to(torch.uint8)
    return q, scale


def dequantize_mxfp8(
    q: torch.Tensor,
    scale: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    chunk_elements: int | None = None,
) -> torch.Tensor:
    """x' = q * 2^(scale - 127), exact in fp32 (byte 0, 2^-127, included), cast to `dtype`.
    `scale` is uint8 or torch.float8_e8m0fnu (the same bytes). `InvalidArgument` if `q` is
    not 2-D e4m3 or `scale` is not rows x ceil(cols/32) of it, or holds the NaN byte 255."""
    rows, cols = _check_quantized(q, "q")
    want = (rows, _ceil(cols, MX_BLOCK))
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    if scale.dtype != torch.uint8 or tuple(scale.shape) != want:
        raise InvalidArgument(
            f"scale is {scale.dtype} {list(scale.shape)}: a {rows}x{cols} mxfp8 weight has "
            f"uint8 (e8m0) {list(want)}"
        )
    if bool((scale == 255).any()):
        raise InvalidArgument("scale holds 255, e8m0's NaN: the block it scales is not a number")
    out = torch.empty((rows, cols), dtype=dtype, device=q.device)
    step = _rows_per_chunk(cols, 1, chunk_elements or default_chunk(q.device))
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        b = scale[r0:r1].to(torch.int32)
        # 2^-127 (byte 0) is below fp32's normals: scale by 2^-126, then halve (both exact).
        factor = pow2(b.clamp(min=1) - E8M0_BIAS) * torch.where(b == 0, 0.5, 1.0)
        factor_full = factor.repeat_interleave(MX_BLOCK, 1)[:, :cols]
        out[r0:r1] = (q[r0:r1].to(torch.float32) * factor_full).to(dtype)
    return out


def shared_exponent(amax: torch.Tensor) -> torch.Tensor:
    """mxfp8's shared exponent (int32) of each block's fp32 `amax`: floor(log2 amax) - 8,
    at least -127; -127 where amax is 0. frexp gives amax = m * 2^e with m in [0.5, 1), so
    floor(log2 amax) is e - 1 exactly (no log2 rounding near a power of two)."""
    _, e = torch.frexp(amax)
    shared = torch.where(amax > 0, e - 1 - MX_EMAX_ELEM, MX_MIN_EXP)
    return shared.clamp(min=MX_MIN_EXP).to(torch.int32)


def pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k in fp32 for integer `k` in [-126, 127], built from its bits (exact on any
    device, where exp2 of a float need not be)."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


class _Chunk:
    """One fp32 buffer of `step` rows of a weight, zero-padded to whole blocks, which each
    chunk is copied into (exactly: bf16, fp16 and fp32 are all fp32 values) and scaled in
    place: a weight's quantization allocates it once."""

    def __init__(self, w: torch.Tensor, step: int, row_block: int, col_block: int) -> None:
        self.w = w
        self.step = step
        self.row_block = row_block
        rows = min(step, _ceil(w.shape[0], row_block) * row_block)
        cols = _ceil(w.shape[1], col_block) * col_block
        self.buf = torch.empty((rows, cols), dtype=torch.float32, device=w.device)

    def load(self, r0: int) -> tuple[torch.Tensor, int]:
        """Rows [r0, r0 + step) of the weight in whole blocks of rows, the padding zero;
        and how many of them are the weight's."""
        part = self.w[r0 : r0 + self.step]
        n, cols = int(part.shape[0]), int(part.shape[1])
        x = self.buf[: _ceil(n, self.row_block) * self.row_block]
        x[:n, :cols].copy_(part)
        x[n:].zero_()
        x[:n, cols:].zero_()
        return x, n


def _amax(blocks: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """max |x| over `dims` as max(max x, -min x): no |x| copy; a NaN propagates."""
    return torch.maximum(blocks.amax(dim=dims), blocks.amin(dim=dims).neg())


def _check(w: torch.Tensor, name: str) -> tuple[int, int]:
    if not isinstance(w, torch.Tensor):
        raise InvalidArgument(f"{name}: a tensor to quantize, not {type(w).__name__}")
    if w.dim() != 2:
        raise InvalidArgument(f"{name}: a view quantizes 2-D weights, not shape {list(w.shape)}")
    if w.dtype not in INPUT_DTYPES:
        raise InvalidArgument(
            f"{name}: {w.dtype}; a view quantizes bfloat16, float16 or float32 weights"
        )
    return int(w.shape[0]), int(w.shape[1])


def _check_quantized(q: torch.Tensor, name: str) -> tuple[int, int]:
    if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.dtype != E4M3:
        what = f"{q.dtype} {list(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise InvalidArgument(f"{name} is {what}: a 2-D float8_e4m3fn tensor is dequantized")
    return int(q.shape[0]), int(q.shape[1])


def _refuse_non_finite(amax: torch.Tensor, w: torch.Tensor, name: str, r0: int, n: int) -> None:
    """NaN and infinities have no e4m3 code a scale can give them (an infinite amax would
    make every scale of its block infinite): refuse, naming the first such element."""
    if bool(torch.isfinite(amax).all()):
        return
    part = w[r0 : r0 + n]
    r, c = (int(i) for i in (~torch.isfinite(part)).nonzero()[0])
    raise InvalidArgument(
        f"{name}[{r0 + r}, {c}] is {float(part[r, c])}: a view quantizes finite weights only"
    )


def _rows_per_chunk(cols: int, granule: int, budget: int) -> int:
    """Rows per chunk: a multiple of `granule` (whole blocks), about `budget` elements."""
    return max(granule, budget // max(cols, 1) // granule * granule)


def _ceil(n: int, d: int) -> int:
    return -(-n // d)
