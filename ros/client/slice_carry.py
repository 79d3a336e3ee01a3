"""The trainer chunks a layout reader's steps share (`ros.client.slice_read`, a reader in a
layout reads the trainer's shards in steps of whole blocks: docs/design-notes.md, "Readers
in another layout").

A trainer chunk may hold parts of blocks of several steps (the shard's tensors are in the
trainer's order, the steps in the block set's). Each step stages the chunks it needs
afresh, so without `Carry` such a chunk would be read from the trainer once per step that
needs it. `Carry` keeps a copy of each such chunk, verified, from the first step that reads
it until the last step that needs it, and no longer: what it holds at once is the chunks
shared by steps still to come, not a shard.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from transport.store import HeldVersion

Shard = int | None


@dataclass
class Carry:
    """Per source shard, how many steps still need each chunk, and copies of the chunks
    read already that a later step needs."""

    uses: dict[Shard, Counter[int]] = field(default_factory=dict)
    kept: dict[tuple[Shard, int], list[torch.Tensor]] = field(default_factory=dict)

    def plan(self, shard: Shard, chunks: Iterable[int]) -> None:
        """One step will need `chunks` of `shard`'s staging (called for every step first)."""
        self.uses.setdefault(shard, Counter()).update(set(chunks))

    def restore(self, shard: Shard, staging: HeldVersion, needed: Iterable[int]) -> None:
        """Copy into `staging` the chunks of `needed` kept from a step before, and mark them
        present: they are not read again."""
        for index in sorted(needed):
            parts = self.kept.get((shard, index))
            if parts is None or staging.is_present(index):
                continue
            for into, part in zip(staging.chunk_parts(index), parts, strict=True):
                into.copy_(part)
            staging.mark_present(index, None)

    def keep(self, shard: Shard, staging: HeldVersion, needed: Iterable[int]) -> None:
        """After a step read `needed` into `staging`: keep a copy of each chunk a later step
        needs too, and forget each one no later step needs."""
        uses = self.uses.setdefault(shard, Counter())
        for index in set(needed):
            uses[index] -= 1
            if uses[index] <= 0:
                self.kept.pop((shard, index), None)
            elif (shard, index) not in self.kept and staging.is_present(index):
                self.kept[(shard, index)] = [p.clone() for p in staging.chunk_parts(index)]
