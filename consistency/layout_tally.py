"""What one version's layout block sets hold in etcd, per layout: how many block sets and the
bytes charged for them (docs/design-notes.md, "Readers in another layout").

One key per version (`Keys.layout_charge`), outside the version's `lb/` prefix so that a
model's keys of this kind are one range (`Keys.layout_charges`). It is put in the
transaction that creates a block set, with the tenant's usage key (`consistency.layouts`),
and read by the release of the version or of its model (`consistency.usage`), so that a
release gives back exactly what was charged, reading one small key per version rather than
every block set's value, and the bounds on layouts per version and block sets per layout
are checked against it exactly, before the write (a compare on its mod_revision).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LayoutTally:
    """Per layout name: (block sets, bytes charged)."""

    layouts: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def charged(self) -> int:
        """The bytes charged for every block set of the version."""
        return sum(nbytes for _, nbytes in self.layouts.values())

    def sets(self, layout: str) -> int:
        return self.layouts.get(layout, (0, 0))[0]

    def add(self, layout: str, nbytes: int) -> LayoutTally:
        """The tally with one more block set of `layout`, charged `nbytes`."""
        sets, held = self.layouts.get(layout, (0, 0))
        return LayoutTally({**self.layouts, layout: (sets + 1, held + nbytes)})

    def encode(self) -> bytes:
        return json.dumps({k: list(v) for k, v in sorted(self.layouts.items())}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> LayoutTally:
        data = json.loads(raw)
        return cls({str(k): (int(v[0]), int(v[1])) for k, v in data.items()})
