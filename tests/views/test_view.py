"""`make_view` on a tiny Llama built from a `LlamaConfig` (no download): the tensors and
metadata a vLLM FP8 / ModelOpt MXFP8 checkpoint has, and logits from the dequantized view
within the formats' bound of the bf16 model's (docs/views.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from ros.manifest_check import check_metadata
from ros.views import (
    META_CONFIG,
    META_FORMAT,
    META_QUANTIZED,
    dequantize_view,
    make_view,
    with_quantization_config,
)
from tensorhub.errors import InvalidArgument

transformers = pytest.importorskip("transformers")

FORMATS = ("fp8-block128", "mxfp8")
SCALE = {
    "fp8-block128": ("weight_scale_inv", torch.float32),
    "mxfp8": ("weight_scale", torch.uint8),
}
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LOGITS_BOUND = 2.0**-3  # relative L2 error of the logits: the weaker format's element bound


def tiny_llama(tie: bool = False) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tie,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_view_has_a_checkpoints_tensors_and_metadata(fmt: str) -> None:
    model = tiny_llama()
    state = model.state_dict()
    tensors, metadata = make_view(state, fmt)
    suffix, scale_dtype = SCALE[fmt]
    quantized = [f"model.layers.{i}.{w}.{n}" for i in range(2) for w, ns in
                 (("self_attn", LINEAR[:4]), ("mlp", LINEAR[4:])) for n in ns]  # fmt: skip
    for module in quantized:
        w, s = tensors[f"{module}.weight"], tensors[f"{module}.{suffix}"]
        n, k = state[f"{module}.weight"].shape
        assert w.dtype == torch.float8_e4m3fn
        assert tuple(w.shape) == (n, k)
        want = (-(-n // 128), -(-k // 128)) if fmt == "fp8-block128" else (n, k // 32)
        assert s.dtype == scale_dtype
        assert tuple(s.shape) == want
    names = [n for n in tensors if not n.endswith(suffix)]
    assert names == list(state)  # the state dict's order, its names, nothing else
    assert len(tensors) == len(state) + len(quantized)
    for name, tensor in state.items():
        if name.removesuffix(".weight") not in quantized:
            assert tensors[name] is tensor  # untouched: the same object
    assert metadata[META_FORMAT] == fmt
    check_metadata(metadata)
    patterns = json.loads(metadata[META_QUANTIZED])
    assert patterns == {f"model.layers.*.{w}.{n}": 2 for w, ns in
                        (("self_attn", LINEAR[:4]), ("mlp", LINEAR[4:])) for n in ns}  # fmt: skip
    config = json.loads(metadata[META_CONFIG])
    ignored = ["lm_head", "model.embed_tokens"]
    if fmt == "fp8-block128":
        assert config == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "weight_block_size": [128, 128], "ignored_layers": ignored}  # fmt: skip
    else:
        assert config == {
            "quant_method": "modelopt",
            "quantization": {
                "quant_algo": "MXFP8",
                "kv_cache_quant_algo": None,
                "exclude_modules": ignored,
            },
        }
    text = with_quantization_config(json.dumps(model.config.to_dict()), config)
    assert json.loads(text)["quantization_config"] == config


@pytest.mark.parametrize("fmt", FORMATS)
def test_logits_of_the_dequantized_view_are_within_the_bound(fmt: str) -> None:
    model = tiny_llama()
    tensors, metadata = make_view(model.state_dict(), fmt)
    restored = tiny_llama()
    restored.load_state_dict(dequantize_view(tensors, metadata))
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits.float()
        got = restored(ids).logits.float()
    error = float((got - want).norm() / want.norm())
    assert 0 < error <= LOGITS_BOUND
    # The weights themselves are back within the element bound.
    for name, tensor in dequantize_view(tensors, metadata, dtype=torch.float32).items():
        base = model.state_dict()[name].float()
        assert float((tensor - base).norm()) <= 2.0**-3 * float(base.norm())


def test_mxfp8_keeps_a_weight_whose_width_is_not_a_multiple_of_32() -> None:
    state = {
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 80).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(80, 64).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.bias": torch.randn(80).to(torch.bfloat16),
    }
    tensors, metadata = make_view(state, "mxfp8")
    assert (
        tensors["model.layers.0.mlp.down_proj.weight"]
        is state["model.layers.0.mlp.down_proj.weight"]
    )
    assert "model.layers.0.mlp.down_proj.weight_scale" not in tensors
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    config = json.loads(metadata[META_CONFIG])
    assert config["quantization"]["exclude_modules"] == ["lm_head", "model.layers.0.mlp.down_proj"]
    tensors, _ = make_view(state, "fp8-block128")  # block128 has partial blocks: quantized
    assert tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 1)


def test_a_tied_model_and_other_linear_names() -> None:
    model = tiny_llama(tie=True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    tensors, metadata = make_view(state, "fp8-block128", linear=frozenset({"q_proj"}))
    assert sum(n.endswith("weight_scale_inv") for n in tensors) == 2
    config = json.loads(metadata[META_CONFIG])
    assert "model.layers.0.mlp.up_proj" in config["ignored_layers"]
    assert "lm_head" in config["ignored_layers"]


def test_refusals() -> None:
    state = {"model.layers.0.self_attn.q_proj.weight": torch.randn(8, 64).to(torch.bfloat16)}
    with pytest.raises(InvalidArgument, match="view format 'fp4'"):
        make_view(state, "fp4")
    bad = {"model.layers.0.self_attn.q_proj.weight": torch.full((8, 64), float("nan"))}
    for fmt in FORMATS:
        with pytest.raises(InvalidArgument, match=r"q_proj\.weight\[0, 0\] is nan"):
            make_view(bad, fmt)
    clash = {**state, "model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(1, 1)}
    with pytest.raises(InvalidArgument, match="in the state dict already"):
        make_view(clash, "fp8-block128")
    with pytest.raises(InvalidArgument, match="view format"):
        dequantize_view(state, {})
    with pytest.raises(InvalidArgument, match="not JSON"):
        with_quantization_config("{", {})
