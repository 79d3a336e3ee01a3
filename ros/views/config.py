"""The `quantization_config` of each view format: what a loader reads from config.json to
load a view (docs/views.md, "The quantization_config").

- `fp8-block128`: DeepSeek-V3's own (README_WEIGHTS.md), which vLLM's `Fp8Config.from_config`
  parses, with `ignored_layers` naming the modules kept in bf16.
- `mxfp8`: the ModelOpt form vLLM's `ModelOptMxFp8Config` parses (`quant_method` "modelopt",
  its `quantization` with `quant_algo` "MXFP8" and the two fields it requires,
  `kv_cache_quant_algo` and `exclude_modules`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tensorhub.errors import InvalidArgument


def quantization_config(fmt: str, ignored: Sequence[str]) -> dict[str, Any]:
    """The `quantization_config` of a view of format `fmt` whose unquantized linear-like
    modules are `ignored`. `InvalidArgument` for a format that is not a view format."""
    if fmt == "fp8-block128":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "ignored_layers": list(ignored),
        }
    if fmt == "mxfp8":
        return {
            "quant_method": "modelopt",
            "quantization": {
                "quant_algo": "MXFP8",
                "kv_cache_quant_algo": None,
                "exclude_modules": list(ignored),
            },
        }
    raise InvalidArgument(f"view format {fmt!r}: one of fp8-block128, mxfp8")


def with_quantization_config(config_json: str, config: Mapping[str, Any]) -> str:
    """The text of a model's config.json with its `quantization_config` set to `config`:
    what a directory holding the view needs beside its weights for vLLM to load it.
    `InvalidArgument` if `config_json` is not a JSON object."""
    try:
        parsed = json.loads(config_json)
    except ValueError as exc:
        raise InvalidArgument(f"config.json is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidArgument(f"config.json holds a {type(parsed).__name__}, not an object")
    parsed["quantization_config"] = dict(config)
    return json.dumps(parsed, indent=2) + "\n"
