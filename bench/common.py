"""Options shared by the emulated-host benchmarks, the byte check every run ends with, and
the count of which transport each fetch read its holders over.

Defaults: 200 Mbit/s links (a plain-socket ring over 9 hosts still saturates them on the 2
cores here; `Saturation` re-checks it every run), a 32 MiB model cut into 256 KiB chunks
(a chain of 8 readers adds 8 chunk times, about 0.1 s, to one transfer), over TCP
(`--transport nixl`: the participants' clients read COMPLETE holders over NIXL, UCX on TCP
over their veths; `bench.emu.cluster`).
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.report import Result
from tensorhub.errors import IntegrityError

MiB = 1 << 20
MODEL = "policy"
TRANSPORTS = ("tcp", "nixl")  # what `--transport` may name (`transport.backend.TransportKind`)


class BytesMismatch(IntegrityError):
    """A receiver's bytes differ from what was sent: the run is invalid."""


class LinksBypassed(IntegrityError):
    """Fewer bytes crossed the emulated links than the copies a phase moved: they went
    another way (cma or shared memory between namespaces), past the shaping, so the phase's
    time says nothing about the links and the run is invalid."""


@dataclass(frozen=True)
class Options:
    """`rate_mbit` per host link, model of `size_mb` MiB, chunks of `chunk_kb` KiB."""

    rate_mbit: float = 200.0
    size_mb: int = 32
    chunk_kb: int = 256
    seed: int = 7
    transport: str = "tcp"

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
        if self.transport != defaults.transport:
            out.append(f"--transport {self.transport}")
        return (" " + " ".join(out)) if out else ""


def add_options(ap: argparse.ArgumentParser, size_mb: int = 32) -> None:
    ap.add_argument("--rate-mbit", type=float, default=200.0, help="each host link (Mbit/s)")
    ap.add_argument("--size-mb", type=int, default=size_mb, help="model size (MiB)")
    ap.add_argument("--chunk-kb", type=int, default=256, help="chunk size (KiB)")


def add_transport(ap: argparse.ArgumentParser) -> None:
    """`--transport`, for the benchmarks whose participants' fetches it changes."""
    ap.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="tcp",
        help="what the clients read holders over: tcp, or nixl (COMPLETE holders over NIXL, "
        "UCX_TLS=tcp on each host's veth; PARTIAL ones over TCP)",
    )


def options(args: argparse.Namespace) -> Options:
    transport = getattr(args, "transport", None) or "tcp"
    return Options(args.rate_mbit, args.size_mb, args.chunk_kb, transport=transport)


def verify(expected: str, replies: Iterable[dict[str, Any]], what: str) -> None:
    """Raise `BytesMismatch` unless every reply's digest equals `expected`."""
    bad = [r.get("digest") for r in replies if r.get("digest") != expected]
    if bad:
        raise BytesMismatch(f"{what}: {len(bad)} receivers got different bytes ({bad[:3]})")


def span(replies: Sequence[dict[str, Any]], start: float | None = None) -> float:
    """From `start` (default: the earliest t0) to the latest t1 among `replies`."""
    first = min(r["t0"] for r in replies) if start is None else start
    return float(max(r["t1"] for r in replies) - first)


def reads(replies: Iterable[dict[str, Any]]) -> dict[str, int]:
    """How the fetches of `replies` read their holders: one read per (fetch, holder that
    sent it bytes), counted by the transport it went over (`FetchStats.transports`);
    `tcp_partial` counts the TCP reads of holders passed over for NIXL because they were
    PARTIAL when planned (`FetchStats.fallbacks`: in a pipelined fan-out a reader behind
    another reader reads it over TCP), `tcp_other` the rest of the TCP reads (in a NIXL run,
    a COMPLETE holder read over TCP: NIXL was not used where it should have been)."""
    out: Counter[str] = Counter({"nixl": 0, "tcp": 0, "tcp_partial": 0, "tcp_other": 0})
    for r in replies:
        got, why = r.get("bytes_per_source", {}), r.get("fallbacks", {})
        for holder, kind in r.get("transports", {}).items():
            if not got.get(holder):
                continue  # planned, but sent nothing (its chunks were all taken by others)
            out[kind] += 1
            if kind == "tcp":
                out["tcp_partial" if "PARTIAL" in why.get(holder, "") else "tcp_other"] += 1
    return dict(out)


def add_reads(total: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    """`total` plus `more`, kind by kind."""
    return {k: total.get(k, 0) + more.get(k, 0) for k in dict.fromkeys([*total, *more])}


def transport_figures(
    res: Result, transport: str, per_copy: float, used: dict[str, int], who: str = "TensorHub"
) -> None:
    """The figures every `--transport` benchmark adds: the lowest link bytes per model copy
    over its measured phases (`bench.emu.cluster.Links.per_copy`; below `ON_LINKS` the run
    already failed with `LinksBypassed`), and in a NIXL run its reads (`reads`) by
    transport: a COMPLETE holder read over TCP is a miss."""
    res.add("link bytes / (copies x model), lowest phase", per_copy)
    if transport != "nixl":
        return
    res.add(f"{who} reads over NIXL", used.get("nixl", 0), unit="reads")
    res.add(f"{who} reads over TCP of PARTIAL holders", used.get("tcp_partial", 0), unit="reads")
    res.add(f"{who} reads over TCP of other holders", used.get("tcp_other", 0), "<= 0", "reads")
