"""A tiny Llama for real-vLLM tests: versions of its weights, and Hugging Face's greedy tokens
for a version (the reference vLLM's output must equal)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

PROMPTS = [[1, 2, 3, 4], [9, 8, 7]]
NEW_TOKENS = 8


def config() -> LlamaConfig:
    # head_dim 64: vLLM's CPU attention refuses smaller heads
    return LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
        head_dim=64, tie_word_embeddings=False,
    )  # fmt: skip


def model(version: int) -> LlamaForCausalLM:
    """Version `version`'s weights: seeded, so every process builds the same ones."""
    torch.manual_seed(1000 + version)
    return LlamaForCausalLM(config()).eval()


def weights(version: int) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in model(version).state_dict().items()}


def tp2_halves(
    tensors: dict[str, torch.Tensor], rank: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """TP rank `rank` of 2: column-parallel weights split on dim 0, row-parallel on dim 1,
    the rest whole (replicated): its tensors and their placements."""
    own: dict[str, torch.Tensor] = {}
    placements: dict[str, Any] = {}
    for name, t in tensors.items():
        dim = 0 if any(k in name for k in ("q_proj", "k_proj", "v_proj", "gate", "up")) else None
        if any(k in name for k in ("o_proj", "down")):
            dim = 1
        if dim is None or t.dim() != 2:
            own[name] = t
            continue
        n = t.shape[dim] // 2
        own[name] = t.narrow(dim, rank * n, n).contiguous()
        offsets = (rank * n, 0) if dim == 0 else (0, rank * n)
        placements[name] = (tuple(t.shape), offsets)
    return own, placements


def save(version: int, where: Path) -> str:
    """Write version `version` as a Hugging Face checkpoint vLLM can start from."""
    model(version).save_pretrained(where)
    return str(where)


def hf_greedy(version: int) -> list[list[int]]:
    m = model(version)
    with torch.no_grad():
        return [
            m.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in PROMPTS
        ]


def vllm_greedy(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def start_llm(checkpoint: str, tp: int = 1) -> Any:
    """A vLLM `LLM` (untyped: vLLM is not installed where mypy runs) of `checkpoint`, its
    weight-transfer engine TensorHub's, its workers answering `collective_rpc(STATUS)`. At
    `tp` > 1 its workers are processes of their own (vLLM's `mp` executor), each pinned to
    one core (`VLLM_CPU_OMP_THREADS_BIND`, which the caller sets)."""
    from vllm import LLM

    from ros.integrations.vllm_worker import WORKER_EXTENSION

    return LLM(
        model=checkpoint, skip_tokenizer_init=True, dtype="float32", max_model_len=64,
        enforce_eager=True, distributed_executor_backend="uni" if tp == 1 else "mp",
        tensor_parallel_size=tp,
        weight_transfer_config={"backend": "tensorhub"}, worker_extension_cls=WORKER_EXTENSION,
    )  # fmt: skip


def status(llm: Any) -> dict[str, Any]:
    """The one worker's TensorHub status (`ros.integrations.vllm_worker`), asked by name."""
    from ros.integrations.vllm_worker import STATUS

    [answer] = llm.collective_rpc(STATUS)
    return dict(answer)


def statuses(llm: Any) -> list[dict[str, Any]]:
    """Every worker's TensorHub status, in rank order."""
    from ros.integrations.vllm_worker import STATUS

    return [dict(answer) for answer in llm.collective_rpc(STATUS)]
