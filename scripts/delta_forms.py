"""Measure the two forms of a `xor-adaptive-zstd1` delta chunk (docs/design-notes.md, "Delta
versions": "Changed words, then"): on `bench delta`'s model (`bench.emu.training`, 69.3 MiB
in bf16, AdamW from fp32 masters), 256 KiB chunks, one thread, each step's bf16 copy
encoded against the step before both ways (every chunk as its changed words, every chunk
as byte planes), with each form's share of the model and the time to apply it to the whole
model (decode, XOR into the base).

    .venv/bin/python scripts/delta_forms.py
"""

from __future__ import annotations

import time

import torch

from bench.emu.training import DEFAULT, Training
from transport import delta, delta_words

CHUNK = 256 << 10
STEPS = {1e-6: (1, 3, 10), 1e-5: (1, 3), 1e-4: (1,)}


def flat(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in weights.values()])


def measure(old: torch.Tensor, new: torch.Tensor, share: float) -> tuple[float, float, float]:
    """Encode every chunk with `MAX_SHARE = share`; (size / model, encode s, apply s)."""
    delta_words.MAX_SHARE = share
    chunks = [(old[i : i + CHUNK], new[i : i + CHUNK]) for i in range(0, new.numel(), CHUNK)]
    start = time.perf_counter()
    encoded = [delta.encode([a], [b]) for a, b in chunks]
    encode_s = time.perf_counter() - start
    dest = [a.clone() for a, _ in chunks]
    start = time.perf_counter()
    for part, blob in zip(dest, encoded, strict=True):
        if blob is not None:
            delta.apply([part], blob)
    apply_s = time.perf_counter() - start
    for part, (_, b), blob in zip(dest, chunks, encoded, strict=True):
        assert blob is None or torch.equal(part, b)
    size = sum(len(e) if e is not None else CHUNK for e in encoded)
    return size / new.numel(), encode_s, apply_s


def main() -> None:
    torch.set_num_threads(1)
    kept = delta_words.MAX_SHARE
    print("| step | words changed | byte planes: size, encode, apply | changed words: size, "
          "encode, apply |")  # fmt: skip
    for lr, wanted in STEPS.items():
        training = Training(DEFAULT, lr)
        old = flat(training.weights())
        for step in range(1, max(wanted) + 1):
            training.step()
            new = flat(training.weights())
            if step in wanted:
                changed = float((old.view(torch.int16) != new.view(torch.int16)).float().mean())
                planes = measure(old, new, 0.0)
                words = measure(old, new, 1.0)
                print(f"| lr {lr:g}, step {step} | {changed:.2%} | "
                      f"{planes[0]:.2%}, {planes[1]:.3f} s, {planes[2]:.3f} s | "
                      f"{words[0]:.2%}, {words[1]:.3f} s, {words[2]:.3f} s |")  # fmt: skip
            old = new
    delta_words.MAX_SHARE = kept


if __name__ == "__main__":
    main()
