"""Views of a version: its linear weights quantized to an FP8 format a rollout engine loads
as it is (docs/views.md).

- `fp8-block128`: e4m3 with an fp32 `weight_scale_inv` per 128x128 block (DeepSeek-V3's FP8
  checkpoints; vLLM's `Fp8Config` with `weight_block_size`).
- `mxfp8`: e4m3 with an e8m0 `weight_scale` per 32 elements of a row (OCP Microscaling
  v1.0; vLLM's ModelOpt MXFP8 checkpoints).

`make_view(state_dict, fmt)` gives the view's tensors and manifest metadata;
`ros.views.formats` holds the arithmetic, `ros.views.selection` which tensors are quantized,
`ros.views.config` the `quantization_config` a loader reads.
"""

from __future__ import annotations

from ros.views.config import quantization_config, with_quantization_config
from ros.views.formats import (
    dequantize_fp8_block128,
    dequantize_mxfp8,
    quantize_fp8_block128,
    quantize_mxfp8,
)
from ros.views.selection import LINEAR_MODULES
from ros.views.view import (
    FORMATS,
    META_CONFIG,
    META_FORMAT,
    META_QUANTIZED,
    dequantize_view,
    make_view,
    view_format,
)

__all__ = [
    "FORMATS",
    "LINEAR_MODULES",
    "META_CONFIG",
    "META_FORMAT",
    "META_QUANTIZED",
    "dequantize_fp8_block128",
    "dequantize_mxfp8",
    "dequantize_view",
    "make_view",
    "quantization_config",
    "quantize_fp8_block128",
    "quantize_mxfp8",
    "view_format",
    "with_quantization_config",
]
