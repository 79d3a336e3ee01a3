"""A view of a state dict: its linear weights in an FP8 format, with the tensor names,
dtypes and manifest metadata a loader of that format needs (docs/views.md).

`make_view(state_dict, fmt)` returns `(tensors, metadata)`:

- `tensors`: the state dict's own tensors, in its order, except each quantized `X.weight`,
  which is its e4m3 form followed by its scales, `X.weight_scale_inv` (fp32, one per
  128x128 block: vLLM's `Fp8Config` / DeepSeek-V3 names) for `fp8-block128`, or
  `X.weight_scale` (uint8 e8m0, one per 32 elements of a row: ModelOpt MXFP8 names) for
  `mxfp8`. The tensors it leaves alone are the same objects, not copies: a view adds its
  quantized weights and scales only (about half the bytes of the weights it quantizes).
- `metadata` (manifest metadata, within `ros.manifest_check`'s bounds): `tensorhub.view`
  (the format), `tensorhub.view.quantization_config` (JSON: config.json's
  `quantization_config` for this view) and `tensorhub.view.quantized` (JSON: how many
  modules were quantized per name pattern; exactly those with a scale tensor in the view).

`dequantize_view(tensors, metadata)` is the inverse a model without FP8 kernels loads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ros.manifest_check import check_metadata
from ros.views.config import quantization_config
from ros.views.formats import (
    dequantize_fp8_block128,
    dequantize_mxfp8,
    quantize_fp8_block128,
    quantize_mxfp8,
)
from ros.views.selection import LINEAR_MODULES, ignored_modules, is_quantized, module_of, summary
from tensorhub.errors import InvalidArgument

META_FORMAT = "tensorhub.view"
META_CONFIG = "tensorhub.view.quantization_config"
META_QUANTIZED = "tensorhub.view.quantized"

Quantize = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Dequantize = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class ViewFormat:
    """A format's name, the suffix its scale tensor takes after the module, and its pair
    of functions (`ros.views.formats`)."""

    name: str
    scale_suffix: str
    quantize: Quantize
    dequantize: Dequantize


FORMATS: dict[str, ViewFormat] = {
    "fp8-block128": ViewFormat(
        "fp8-block128", "weight_scale_inv", quantize_fp8_block128, dequantize_fp8_block128
    ),
    "mxfp8": ViewFormat("mxfp8", "weight_scale", quantize_mxfp8, dequantize_mxfp8),
}


def view_format(fmt: str) -> ViewFormat:
    """The format named `fmt`; `InvalidArgument` for any other name."""
    if fmt not in FORMATS:
        raise InvalidArgument(f"view format {fmt!r}: one of {', '.join(FORMATS)}")
    return FORMATS[fmt]


def make_view(
    state_dict: Mapping[str, torch.Tensor],
    fmt: str,
    *,
    linear: frozenset[str] = LINEAR_MODULES,
    chunk_elements: int | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The view of `state_dict` in format `fmt` (module docstring), quantized on each
    tensor's own device. `InvalidArgument` for an unknown format, a weight that holds a NaN
    or an infinity or has a dtype that is not bf16/fp16/fp32, or a state dict that already
    has a tensor of a scale's name; nothing is returned then."""
    spec = view_format(fmt)
    tensors: dict[str, torch.Tensor] = {}
    quantized: list[str] = []
    for name, tensor in state_dict.items():
        module = module_of(name)
        if module is None or not is_quantized(name, tensor, fmt, linear):
            tensors[name] = tensor
            continue
        scale_name = f"{module}.{spec.scale_suffix}"
        if scale_name in state_dict:
            raise InvalidArgument(
                f"{scale_name} is in the state dict already: the view of {name} writes it"
            )
        tensors[name], tensors[scale_name] = spec.quantize(
            tensor, name=name, chunk_elements=chunk_elements
        )
        quantized.append(module)
    return tensors, view_metadata(fmt, state_dict, quantized)


def view_metadata(
    fmt: str, state_dict: Mapping[str, torch.Tensor], quantized: Sequence[str]
) -> dict[str, str]:
    """The manifest metadata of the `fmt` view of `state_dict` whose `quantized` modules
    were quantized (module docstring). Only the tensors' names and dimensions are read:
    a model-parallel view passes its whole weights' shapes (`ros.views.shard_view`)."""
    config = quantization_config(fmt, ignored_modules(state_dict, quantized))
    metadata = {
        META_FORMAT: fmt,
        META_CONFIG: json.dumps(config, separators=(",", ":")),
        META_QUANTIZED: json.dumps(summary(quantized), separators=(",", ":")),
    }
    check_metadata(metadata, f"metadata of the {fmt} view")
    return metadata


def dequantize_view(
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    *,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """The state dict a view stands for: each quantized `X.weight` dequantized to `dtype`
    with its scales (which are dropped), every other tensor as it is. `InvalidArgument` if
    `metadata` names no view format or a scale has no weight."""
    spec = view_format(metadata.get(META_FORMAT, ""))
    suffix = "." + spec.scale_suffix
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(suffix):
            if name[: -len(suffix)] + ".weight" not in tensors:
                raise InvalidArgument(f"{name} scales no weight of the view")
            continue
        module = module_of(name)
        scale = tensors.get(f"{module}{suffix}") if module is not None else None
        out[name] = tensor if scale is None else spec.dequantize(tensor, scale, dtype=dtype)
    return out
