"""Delta versions in the whole-version workload (docs/chaos.md, "Delta versions").

Publishers publish with `delta=True`, so each version a publisher publishes after one of its
own is also published as a delta against it (`{model}.delta`@v, docs/sdk.md). For a delta to
be worth sending, a version must be a small change of the one before, as an RL step is:
`Weights` makes each next version from the last by rewriting about 1 % of the bytes of every
tensor at random places (so every chunk changes, and encodes small) and one chunk of one
weight whole (so every delta also has a chunk sent whole: its encoding is larger than 0.8x).
Each publisher starts from its own random bytes, so the versions of two racing publishers
share nothing, and every version's bytes are new: the checker still tells every version, and
every publisher's attempt at it, apart by its hash.

Readers fetch in one of `READ_MODES` (`reader-i` takes mode i mod 3):

- `in-place`: one buffer; release the version held, then fetch the next into the same
  memory, so the SDK knows the memory holds the version it fetched last (`BaseMemory`) and
  applies the delta from it. A quarter of these fetches first flip one byte of the
  released memory (`scribbled` in the record), as an engine may write to memory it no
  longer serves: the SDK must find that chunk is not the base's and read it whole;
- `double-base`: two buffers, as before, and the fetch names the version the spare buffer
  last held completely (`base=b`): a chain of deltas when it is two or more versions behind.
  After a fetch into it failed, the buffer is partly overwritten and the reader still names
  the old version: the SDK must find each chunk that is no longer the base's and read it
  whole (`DeltaStats.base_mismatch`);
- `double`: two buffers, no base named: whole reads (the workload before deltas).

Every fetch records what its delta did (`delta_record`), and the checker compares its bytes
with the published bytes of its version like any other read (invariant 1).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from chaos.history import Op
    from ros.client.delta_fetch import DeltaStats

READ_MODES = ("in-place", "double-base", "double")
CHANGED = 0.01  # share of each tensor's bytes a version rewrites


class Weights:
    """One publisher's versions: each a small change of the one before (module docstring).

    `next()` returns new tensors every time: a published version is served from its own
    memory until released, so it is never written again."""

    def __init__(self, shapes: dict[str, int], chunk: int, seed: int) -> None:
        self.chunk = chunk
        self.gen = torch.Generator().manual_seed(seed)
        self.current = {
            name: torch.randint(0, 256, (n,), dtype=torch.uint8, generator=self.gen)
            for name, n in shapes.items()
        }

    def next(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in self.current.items():
            new = t.clone()
            k = max(1, int(t.numel() * CHANGED))
            where = torch.randint(0, t.numel(), (k,), generator=self.gen)
            new[where] = torch.randint(0, 256, (k,), dtype=torch.uint8, generator=self.gen)
            out[name] = new
        big = sorted(name for name, t in out.items() if t.numel() >= self.chunk)
        if big:  # one chunk rewritten whole
            name = big[int(torch.randint(0, len(big), (1,), generator=self.gen))]
            chunks = out[name].numel() // self.chunk
            at = int(torch.randint(0, chunks, (1,), generator=self.gen)) * self.chunk
            out[name][at : at + self.chunk] = torch.randint(
                0, 256, (self.chunk,), dtype=torch.uint8, generator=self.gen
            )
        self.current = out
        return out


def delta_record(stats: DeltaStats | None) -> dict[str, Any]:
    """What a fetch's delta did, for its history record (empty: no delta was tried)."""
    if stats is None:
        return {}
    return {
        "delta": {
            "base": stats.base, "links": stats.links, "chunks": stats.chunks,
            "encoded_bytes": stats.encoded_bytes, "whole_chunks": stats.whole_chunks,
            "base_mismatch": stats.base_mismatch, "fallback": stats.fallback[:200],
        }
    }  # fmt: skip


def applied(op: Op) -> bool:
    """Whether a completed fetch made chunks from a delta."""
    return int(op.value.get("delta", {}).get("chunks", 0)) > 0


def delta_counts(ops: Iterable[Op]) -> dict[str, int]:
    """How much the run exercised deltas: publishes that sent one, and reads by what their
    delta did (all of them compared with the published bytes like any other read)."""
    ok = [op for op in ops if op.outcome == "ok"]
    fetches = [op for op in ok if op.f == "fetch"]
    tried = [op for op in fetches if op.value.get("delta")]
    used = [op for op in tried if applied(op)]
    return {
        "publishes with a delta": sum(
            op.f == "publish" and bool(op.value.get("delta_base")) for op in ok
        ),
        "fetches that applied a delta": len(used),
        "of those, a chain of 2 or more deltas": sum(
            int(op.value["delta"]["links"]) > 1 for op in used
        ),
        "of those, with chunks read whole too": sum(
            int(op.value["delta"]["whole_chunks"]) > 0 for op in used
        ),
        "fetches that found their memory not the base (chunks read whole)": sum(
            int(op.value["delta"]["base_mismatch"]) > 0 for op in tried
        ),
        "fetches whose delta was not used (read whole)": sum(
            bool(op.value["delta"]["fallback"]) and not applied(op) for op in tried
        ),
    }
