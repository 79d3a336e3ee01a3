"""Which tensors of a state dict a view quantizes: vLLM's convention, the linear layers'
2-D weights (docs/views.md, "Which tensors").

A tensor `X.weight` is quantized when `X`'s last component names a linear layer
(`LINEAR_MODULES`: the attention and MLP projections and their merged forms) and it is 2-D;
for `mxfp8` also when its input (last) dimension is a multiple of 32, the only layout
vLLM's MXFP8 loader has (a weight of another width stays bf16 and is listed as ignored).
Everything else is the version's own tensor, untouched: embeddings, norms, biases, `lm_head`,
routers, anything that is not 2-D. Names only: no module types are known here, so a model
whose linear layers have other names passes its own set (`linear=`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

import torch

from ros.views.formats import MX_BLOCK

LINEAR_MODULES = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj",
    "gate_proj", "up_proj", "down_proj", "gate_up_proj",
})  # fmt: skip
ALWAYS_IGNORED = ("lm_head",)  # never quantized, named so even when tied to the embedding
WEIGHT = ".weight"


def module_of(name: str) -> str | None:
    """`X` for a tensor named `X.weight`, else None."""
    return name[: -len(WEIGHT)] if name.endswith(WEIGHT) and len(name) > len(WEIGHT) else None


def is_quantized(
    name: str, tensor: torch.Tensor, fmt: str, linear: frozenset[str] = LINEAR_MODULES
) -> bool:
    """Whether a view of format `fmt` quantizes `tensor`, named `name` (module docstring)."""
    module = module_of(name)
    if module is None or module.rsplit(".", 1)[-1] not in linear or tensor.dim() != 2:
        return False
    return not (fmt == "mxfp8" and tensor.shape[1] % MX_BLOCK)


def ignored_modules(state_dict: Mapping[str, torch.Tensor], quantized: Iterable[str]) -> list[str]:
    """The modules a loader must keep unquantized: every `X` of a 2-D `X.weight` the view
    leaves as it is, and `lm_head`, sorted (vLLM's `ignored_layers` / `exclude_modules`).
    Naming an embedding there is harmless: vLLM's FP8 configs quantize linear layers only."""
    done = set(quantized)
    kept = {
        module
        for name, tensor in state_dict.items()
        if (module := module_of(name)) is not None and tensor.dim() == 2 and module not in done
    }
    return sorted(kept | set(ALWAYS_IGNORED))


def summary(modules: Iterable[str]) -> dict[str, int]:
    """How many quantized modules match each pattern, the layer and expert indices written
    `*` (`model.layers.*.self_attn.q_proj`: 32): a size that does not grow with depth."""
    patterns = (".".join("*" if c.isdigit() else c for c in m.split(".")) for m in modules)
    return dict(sorted(Counter(patterns).items()))
