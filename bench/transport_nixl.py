"""The NIXL rows of `tensorhub bench transport` (`bench.transport`; docs/nixl.md).

One holder process per NIXL mode serves the bench's model with `NixlHolder`, under that
mode's UCX settings; this process reads it with a `NixlReader` made under the same
settings (UCX reads `UCX_*` when an agent's context is created, so each mode has its own
holder process and its own reader agent):

- `tcp`: UCX's TCP transport on loopback, with 1 MiB segments (`UCX_TLS=tcp
  UCX_NET_DEVICES=lo UCX_TCP_TX_SEG_SIZE=1m UCX_TCP_RX_SEG_SIZE=1m`): compared with the
  plain Python socket on one connection;
- `cma`: same-host cross-memory attach, `process_vm_readv` (`UCX_TLS=cma,tcp`, TCP only for
  UCX's wire-up, as in tests/transport/test_nixl.py): compared with a memcpy of the same
  model-sized buffer in this process, on one thread, its ceiling (cma is one copy, on one
  thread, from one process's memory into another's).

Each read is one channel (`NixlReader.open(f, source, None)` then `channel.read`), timed from
the connect to the last chunk committed: every chunk checked against the publisher's xxh3
by the channel (`transport.verification`, as in a fetch). Any outcome but DONE raises
(`IntegrityError` for a corrupt chunk, `TransportError` for anything else), and the
destination is zeroed before each read, untimed, so bytes an earlier read left there cannot
pass for bytes this one read. Where NIXL cannot be imported, `Nixl.note` says why and no row
is added.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import TracebackType

import torch

from bench.open_verifier import allow_all
from tensorhub.errors import IntegrityError, TransportError
from transport.fetch_state import FetchState
from transport.layout import Layout
from transport.nixl.holder import NixlHolder
from transport.nixl.loader import unavailable_reason
from transport.nixl.reader import NixlReader
from transport.outcome import ChunkStatus
from transport.planner import Source
from transport.store import HeldVersion, HolderStore

Model = Callable[[int], dict[str, torch.Tensor]]
"""The bench's model of `size_mb` MiB (`bench.transport._model`): built in each holder."""

UCX: dict[str, dict[str, str]] = {
    "tcp": {
        "UCX_TLS": "tcp",
        "UCX_NET_DEVICES": "lo",
        "UCX_TCP_TX_SEG_SIZE": "1m",
        "UCX_TCP_RX_SEG_SIZE": "1m",
    },
    "cma": {"UCX_TLS": "cma,tcp", "UCX_NET_DEVICES": "lo"},
}
"""Each mode's UCX settings, for its holder process and its reader agent alike (docs/nixl.md,
"Measured here")."""

DEADLINE = 120.0  # seconds one NIXL read may take before it fails (as the TCP fetch's)


@contextlib.contextmanager
def ucx_env(settings: Mapping[str, str]) -> Iterator[None]:
    """`os.environ` with `settings` as its only `UCX_*` variables (and NIXL's log at WARN
    unless set), restored on exit: what an agent created, or a process spawned, meanwhile
    reads."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("UCX_") or k == "NIXL_LOG_LEVEL"}
    for name in saved:
        del os.environ[name]
    os.environ.update(settings)
    os.environ["NIXL_LOG_LEVEL"] = saved.get("NIXL_LOG_LEVEL", "WARN")
    try:
        yield
    finally:
        for name in [k for k in os.environ if k.startswith("UCX_") or k == "NIXL_LOG_LEVEL"]:
            del os.environ[name]
        os.environ.update(saved)


def _holder(model: Model, size_mb: int, chunk: int, pipe: Connection) -> None:
    """Child process: serve the model with a NIXL holder under this process's UCX settings."""
    tensors = model(size_mb)
    layout = Layout.from_tensors(tensors, chunk_size=chunk)
    store = HolderStore()
    held = HeldVersion.publisher("bench", "model", 1, tensors, layout)
    held.precompute_checksums()  # publish-time work, outside the measured reads
    store.add(held)
    holder = NixlHolder(store, allow_all).start()
    store.watch(holder.register, holder.release)
    sums = [held.checksum(i) for i in range(layout.num_chunks)]
    pipe.send((holder.address, layout.digest, sums))
    pipe.recv()  # parent says stop
    holder.stop()


@dataclass
class _Mode:
    """One NIXL mode: its holder process, its reader agent, its timed reads."""

    name: str
    child: BaseProcess
    pipe: Connection
    reader: NixlReader
    source: Source
    expected: list[int]
    seconds: list[float] = field(default_factory=list)
    chunks: int = 0  # chunks read, verified and committed, the warm-up's too (all DONE)


def memcpy_once(dst: torch.Tensor, src: torch.Tensor) -> float:
    """Seconds for one libc memcpy of `src` into `dst` (host, contiguous, one thread)."""
    n = src.numel() * src.element_size()
    start = time.perf_counter()
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
    return time.perf_counter() - start


class Nixl:
    """The NIXL rows' holders, readers and timings, for one bench run. Used as a context
    manager around the bench's measurements; `enabled` false (with `note` saying why) where
    the rows are turned off or NIXL cannot be imported, and then every method does nothing."""

    def __init__(
        self,
        model: Model,
        size_mb: int,
        layout: Layout,
        into: dict[str, torch.Tensor],
        src: torch.Tensor,
        *,
        enabled: bool = True,
    ) -> None:
        why: str | None = "--no-nixl"
        if enabled:
            with ucx_env({k: v for k, v in os.environ.items() if k.startswith("UCX_")}):
                why = unavailable_reason()  # imports NIXL: its log level is read then
        self.note = "" if why is None else f"NIXL rows skipped: {why}"
        self._model, self._size_mb, self._layout, self._into = model, size_mb, layout, into
        self._src = src.view(-1)  # the memcpy's source: a touched model-sized buffer
        self._dst: torch.Tensor | None = None
        self._modes: list[_Mode] = []
        self._kept: list[_Mode] = []  # the modes measured, once closed
        self.memcpy_s: list[float] = []

    @property
    def enabled(self) -> bool:
        return not self.note

    def __enter__(self) -> Nixl:
        if not self.enabled:
            return self
        try:
            for name in UCX:
                self._modes.append(self._start(name))
            self._dst = torch.zeros_like(self._src)  # touched, like every receiver's
            for mode in self._modes:  # the holder registers the model: publish-time work
                self._read(mode, [0])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _start(self, name: str) -> _Mode:
        """Start `name`'s holder process and make its reader agent, both under its UCX
        settings."""
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        with ucx_env(UCX[name]):
            child = ctx.Process(
                target=_holder,
                args=(self._model, self._size_mb, self._layout.chunk_size, theirs),
                daemon=True,
            )
            child.start()
            try:
                if ours not in wait([ours, child.sentinel], DEADLINE):  # started, died, late
                    why = f"exited with {child.exitcode}" if child.exitcode is not None else "hung"
                    raise TransportError(f"the NIXL-{name} holder did not start: {why}")
                address, digest, expected = ours.recv()
                if digest != self._layout.digest:
                    raise TransportError(f"the NIXL-{name} holder serves another layout")
                reader = NixlReader()
            except BaseException:
                ours.send("stop")
                child.join(timeout=5)
                raise
        source = Source(f"nixl-{name}", address[0], address[1])
        return _Mode(name, child, ours, reader, source, expected)

    def measure(self) -> None:
        """One timed read per mode, then one memcpy: one round, interleaved with the
        bench's other measurements."""
        if not self.enabled:
            return
        for mode in self._modes:
            mode.seconds.append(self._read(mode, range(self._layout.num_chunks)))
        assert self._dst is not None
        self.memcpy_s.append(memcpy_once(self._dst, self._src))

    def _read(self, mode: _Mode, chunks: Sequence[int]) -> float:
        """Seconds for one channel of `mode` to read `chunks` into the zeroed destination;
        raises unless every chunk is DONE (read, verified, committed)."""
        for t in self._into.values():  # untimed: stale right bytes must not verify
            t.zero_()
        dest = HeldVersion.reader("bench", "model", 1, self._layout, self._into)
        start = time.perf_counter()
        f = FetchState(
            "bench", "model", 1, dest, b"", time.monotonic() + DEADLINE, DEADLINE, mode.expected
        )
        counts: collections.Counter[ChunkStatus] = collections.Counter()
        first: BaseException | None = None
        channel = mode.reader.open(f, mode.source, None)
        try:
            for out in channel.read(chunks):
                counts[out.status] += 1
                if out.status is not ChunkStatus.DONE and first is None:
                    first = out.error
        finally:
            channel.close()
        elapsed = time.perf_counter() - start
        if counts[ChunkStatus.DONE] != len(chunks):
            seen = ", ".join(f"{s.value} {n}" for s, n in sorted(counts.items(), key=str))
            why = (
                f"NIXL-{mode.name} read {len(chunks)} chunks: {seen or 'no outcome'}"
                f" (first error: {first!r})"
            )
            raise (IntegrityError if counts[ChunkStatus.CORRUPT] else TransportError)(why)
        mode.chunks += len(chunks)
        return elapsed

    def close(self) -> None:
        """Close every reader agent and stop every holder process."""
        modes, self._modes = self._modes, []
        for mode in modes:
            mode.reader.close()
            with contextlib.suppress(OSError):
                mode.pipe.send("stop")
            mode.child.join(timeout=5)
            if mode.child.is_alive():  # a holder that does not stop is not left behind
                mode.child.kill()
                mode.child.join(timeout=5)
        self._kept += modes  # their timings, for `rows`

    def rows(self, plain_1conn: float) -> tuple[list[tuple[str, float, str]], dict[str, object]]:
        """The figures (name, value, unit; a ratio has no unit) and the JSON details, given
        the plain socket's GB/s on one connection; none where the rows are off."""
        if not self.enabled:
            return [], {}
        size = self._layout.total_bytes
        by = {m.name: m for m in self._kept}

        def gbps(seconds: Sequence[float]) -> float:
            return size / min(seconds) / 1e9  # best of N, as every row of the bench

        tcp, cma, memcpy = gbps(by["tcp"].seconds), gbps(by["cma"].seconds), gbps(self.memcpy_s)
        rows = [
            ("NIXL-tcp / plain socket (1 conn)", tcp / plain_1conn, ""),
            ("NIXL-cma / memcpy", cma / memcpy, ""),
            ("NIXL-tcp (1 conn)", tcp, "GB/s"),
            ("NIXL-cma (1 conn)", cma, "GB/s"),
            ("memcpy, one process, 1 thread", memcpy, "GB/s"),
        ]
        details: dict[str, object] = {
            m.name: {
                "GBps": round(gbps(m.seconds), 3),
                "median_GBps": round(size / statistics.median(m.seconds) / 1e9, 3),
                "seconds": m.seconds,
                "chunks_verified": m.chunks,
                "ucx": UCX[m.name],
            }
            for m in self._kept
        }
        details |= {
            "memcpy_GBps": round(memcpy, 3),
            "memcpy_seconds": self.memcpy_s,
            "ratio_tcp_to_plain": round(tcp / plain_1conn, 3),
            "ratio_cma_to_memcpy": round(cma / memcpy, 3),
        }
        return rows, details
