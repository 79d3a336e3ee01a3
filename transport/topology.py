"""Topology labels of a process and the distance between two of them (docs/design.md,
"Fetch and the data plane")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

SAME_HOST, SAME_RACK, SAME_DC, OTHER_DC = 0, 1, 2, 3
LABELS = ("dc", "rack", "host")


@dataclass(frozen=True)
class Topology:
    """Where a process runs. Empty labels compare equal, so an unlabelled single-host
    deployment sees every peer as same-host, which is what it is."""

    dc: str = ""
    rack: str = ""
    host: str = ""

    @classmethod
    def of(cls, labels: Mapping[str, str]) -> Topology:
        """The topology a holder record's labels give (other labels are ignored)."""
        return cls(**{k: v for k, v in labels.items() if k in LABELS})

    def labels(self) -> dict[str, str]:
        """The labels set, as a holder record or a request carries them."""
        return {k: v for k, v in vars(self).items() if v}


def distance(a: Topology, b: Topology) -> int:
    """0 same host, 1 same rack, 2 same dc, 3 other dc. Lower is preferred as a source."""
    if a.dc != b.dc:
        return OTHER_DC
    if a.rack != b.rack:
        return SAME_DC
    if a.host != b.host:
        return SAME_RACK
    return SAME_HOST
