"""Measure the delta encodings considered for delta versions (docs/design-notes.md, "Delta
versions"): a small Llama (transformers, built from a config, no download) trained with
AdamW from fp32 masters for 3 steps at each learning rate, its bf16 copies compared step to
step, and each encoding's size (share of the bf16 model) and time over 4 MiB chunks.

    .venv/bin/python scripts/delta_encodings.py

lz4 is measured only if it is installed (it is no dependency of the project).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable

import torch
import zstandard
from transformers import LlamaConfig, LlamaForCausalLM

CHUNK = 4 << 20
STEPS = 3


def flat_bf16(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().to(torch.bfloat16).reshape(-1) for p in model.parameters()])


def shuffle(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8).reshape(-1, 2).t().contiguous().reshape(-1)


def encodings() -> dict[str, Callable[[torch.Tensor, torch.Tensor], int]]:
    """name -> f(old, new) -> encoded bytes, for int16 views of one chunk."""
    zstd = zstandard.ZstdCompressor(level=1)

    def positions(old: torch.Tensor, new: torch.Tensor) -> int:
        return int((old != new).sum()) * 6  # int32 index + bf16 value per changed element

    def gaps_zstd(old: torch.Tensor, new: torch.Tensor) -> int:
        idx = torch.nonzero(old != new).reshape(-1)
        gaps = torch.diff(idx, prepend=torch.zeros(1, dtype=idx.dtype)).to(torch.int32)
        return len(zstd.compress(gaps.numpy().tobytes() + new[idx].numpy().tobytes()))

    out: dict[str, Callable[[torch.Tensor, torch.Tensor], int]] = {
        "positions+values": positions,
        "gap positions+values, zstd-1": gaps_zstd,
        "xor, zlib-1": lambda o, n: len(zlib.compress((o ^ n).numpy().tobytes(), 1)),
        "xor, zstd-1": lambda o, n: len(zstd.compress((o ^ n).numpy().tobytes())),
        "xor, byte planes, zstd-1 (chosen)": lambda o, n: len(
            zstd.compress(shuffle(o ^ n).numpy().tobytes())
        ),
    }
    try:
        import lz4.frame  # type: ignore[import-not-found]

        out["xor, lz4"] = lambda o, n: len(lz4.frame.compress((o ^ n).numpy().tobytes()))
    except ImportError:
        pass
    return out


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    cfg = LlamaConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip
    start = LlamaForCausalLM(cfg).state_dict()
    print(f"model: {sum(t.numel() for t in start.values()) * 2 / 2**20:.1f} MiB in bf16")
    codecs = encodings()
    for lr in (1e-6, 1e-5, 1e-4):
        model = LlamaForCausalLM(cfg)
        model.load_state_dict(start)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        prev = flat_bf16(model).view(torch.int16)
        for step in range(STEPS):
            data = torch.randint(0, cfg.vocab_size, (8, 128))
            opt.zero_grad()
            model(input_ids=data, labels=data).loss.backward()
            opt.step()
            cur = flat_bf16(model).view(torch.int16)
            full = cur.numel() * 2
            row = [f"lr {lr:g} step {step}: {(cur != prev).float().mean().item():.2%} changed"]
            for name, codec in codecs.items():
                size, took = 0, 0.0
                for at in range(0, cur.numel(), CHUNK // 2):
                    t0 = time.perf_counter()
                    size += codec(prev[at : at + CHUNK // 2], cur[at : at + CHUNK // 2])
                    took += time.perf_counter() - t0
                row.append(f"{name}: {size / full:.2%} in {took:.3f} s")
            print("; ".join(row), flush=True)
            prev = cur


if __name__ == "__main__":
    main()
