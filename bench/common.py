"""Options shared by the emulated-host benchmarks, and the byte check every run ends with.

Defaults: 200 Mbit/s links (a plain-socket ring over 9 hosts still saturates them on the 2
cores here; `Saturation` re-checks it every run), a 32 MiB model cut into 256 KiB chunks
(a chain of 8 readers adds 8 chunk times, about 0.1 s, to one transfer).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tensorhub.errors import IntegrityError

MiB = 1 << 20
MODEL = "policy"


class BytesMismatch(IntegrityError):
    """A receiver's bytes differ from what was sent: the run is invalid."""


@dataclass(frozen=True)
class Options:
    """`rate_mbit` per host link, model of `size_mb` MiB, chunks of `chunk_kb` KiB."""

    rate_mbit: float = 200.0
    size_mb: int = 32
    chunk_kb: int = 256
    seed: int = 7

    @property
    def nbytes(self) -> int:
        return self.size_mb * MiB

    @property
    def chunk(self) -> int:
        return self.chunk_kb * 1024

    @property
    def rate_Bps(self) -> float:  # noqa: N802  (bytes, not bits)
        return self.rate_mbit * 1e6 / 8

    def flags(self) -> str:
        defaults = Options()
        out = []
        if self.rate_mbit != defaults.rate_mbit:
            out.append(f"--rate-mbit {self.rate_mbit:g}")
        if self.size_mb != defaults.size_mb:
            out.append(f"--size-mb {self.size_mb}")
        if self.chunk_kb != defaults.chunk_kb:
            out.append(f"--chunk-kb {self.chunk_kb}")
        return (" " + " ".join(out)) if out else ""


def add_options(ap: argparse.ArgumentParser, size_mb: int = 32) -> None:
    ap.add_argument("--rate-mbit", type=float, default=200.0, help="each host link (Mbit/s)")
    ap.add_argument("--size-mb", type=int, default=size_mb, help="model size (MiB)")
    ap.add_argument("--chunk-kb", type=int, default=256, help="chunk size (KiB)")


def options(args: argparse.Namespace) -> Options:
    return Options(args.rate_mbit, args.size_mb, args.chunk_kb)


def verify(expected: str, replies: Iterable[dict[str, Any]], what: str) -> None:
    """Raise `BytesMismatch` unless every reply's digest equals `expected`."""
    bad = [r.get("digest") for r in replies if r.get("digest") != expected]
    if bad:
        raise BytesMismatch(f"{what}: {len(bad)} receivers got different bytes ({bad[:3]})")


def span(replies: Sequence[dict[str, Any]], start: float | None = None) -> float:
    """From `start` (default: the earliest t0) to the latest t1 among `replies`."""
    first = min(r["t0"] for r in replies) if start is None else start
    return float(max(r["t1"] for r in replies) - first)
