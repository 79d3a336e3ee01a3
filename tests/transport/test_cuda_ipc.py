"""Same-host CUDA IPC between two processes on one GPU (issue 15). Needs a CUDA device.

The holder is a process of its own (tests/transport/ipc_holder_proc.py) that serves a
GPU-resident version over TCP and CUDA IPC; this process reads it into its own GPU memory.
On one GPU only same-device IPC can be tested (two GPUs would test peer mappings too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.transport._model import MODEL, TENANT, make_model
from transport.backend import TransportKind
from transport.checksums import WSUM64, XXH3
from transport.layout import Layout
from transport.outcome import FetchStats
from transport.planner import Source
from transport.reader import read_round
from transport.store import HeldVersion
from transport.topology import Topology

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA device: torch.cuda.is_available() is False",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 256 * 1024
SEED = 11


class Holder:
    """The holder process: its ports, and the commands it obeys on stdin."""

    def __init__(self, chunk_size: int = CHUNK) -> None:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.transport.ipc_holder_proc",
             "--seed", str(SEED), "--chunk-size", str(chunk_size)],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        words = self._line().split()
        assert words[:1] == ["PORTS"], f"holder did not start: {words}"
        self.tcp, self.ipc = int(words[1]), int(words[2])

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line()

    def source(self, name: str = "gpu-holder") -> Source:
        return Source(
            name, "127.0.0.1", self.ipc, transport=TransportKind.IPC, tcp=("127.0.0.1", self.tcp),
        )  # fmt: skip

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@pytest.fixture
def holder() -> Iterator[Holder]:
    h = Holder()
    yield h
    h.close()


def _expected() -> tuple[dict[str, torch.Tensor], Layout]:
    model = make_model(SEED, tiny=200)
    return model, Layout.from_tensors(model, chunk_size=CHUNK)


def _read(
    source: Source, layout: Layout, *, checksum: str, expected: list[int] | None,
    token: bytes = b"ok", device: str = "cuda",
) -> tuple[HeldVersion, FetchStats, object]:  # fmt: skip
    dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate(device))
    stats = FetchStats()
    result = read_round(
        TENANT, MODEL, 1, layout, dest, [source], token=token, deadline=time.monotonic() + 60,
        me=Topology(), stats=stats, expected=expected, checksum=checksum,
    )  # fmt: skip
    return dest, stats, result


def _sums(model: dict[str, torch.Tensor], layout: Layout, kind: str) -> list[int]:
    held = HeldVersion.publisher(TENANT, MODEL, 1, model, layout)
    if kind == WSUM64:
        return [held.wsum64(i) for i in range(layout.num_chunks)]
    return [held.checksum(i) for i in range(layout.num_chunks)]


@pytest.mark.parametrize("kind", [WSUM64, XXH3])
def test_a_gpu_reader_copies_a_same_host_holder_device_to_device(holder: Holder, kind: str) -> None:
    model, layout = _expected()
    expected = _sums(model, layout, kind)
    dest, stats, result = _read(holder.source(), layout, checksum=kind, expected=expected)
    assert result.done, result  # type: ignore[attr-defined]
    assert stats.transports == {"gpu-holder": "ipc"}
    assert stats.fallbacks == {}
    assert stats.bytes_per_source["gpu-holder"] == sum(t.nbytes for t in layout.tensors)
    for name, t in model.items():
        got = dest.tensors[name]
        assert got.is_cuda, name
        assert torch.equal(got.cpu(), t), name
    assert holder.ask("leases") == "LEASES 0"  # every lease ended with the fetch


def test_a_wrong_token_gets_no_handle_and_nothing_is_read(holder: Holder) -> None:
    _, layout = _expected()
    dest, stats, result = _read(holder.source(), layout, checksum=WSUM64, expected=None,
                                token=b"stolen")  # fmt: skip
    assert not result.done  # type: ignore[attr-defined]
    assert "PermissionDenied" in stats.failed_sources["gpu-holder"]
    assert dest.missing() == list(range(layout.num_chunks))


def test_a_host_memory_reader_reads_the_gpu_holder_over_tcp_and_says_why(holder: Holder) -> None:
    model, layout = _expected()
    dest, stats, result = _read(holder.source("h2"), layout, checksum=WSUM64,
                                expected=_sums(model, layout, WSUM64), device="cpu")  # fmt: skip
    assert result.done  # type: ignore[attr-defined]
    assert stats.transports == {"h2": "tcp"}
    assert stats.fallbacks == {"h2": "ipc: the destination is in host memory"}
    for name, t in model.items():
        assert torch.equal(dest.tensors[name], t), name


def test_a_release_waits_for_the_lease_and_a_later_reader_is_refused(holder: Holder) -> None:
    model, layout = _expected()
    _, stats, result = _read(holder.source(), layout, checksum=WSUM64,
                             expected=_sums(model, layout, WSUM64))  # fmt: skip
    assert result.done  # type: ignore[attr-defined]
    assert holder.ask("release 10") == "RELEASED ok"
    assert holder.ask("overwrite") == "OVERWRITTEN"
    dest, stats, result = _read(holder.source("again"), layout, checksum=WSUM64,
                                expected=_sums(model, layout, WSUM64))  # fmt: skip
    assert not result.done  # type: ignore[attr-defined]
    assert "VersionUnavailable" in stats.failed_sources["again"]
    assert dest.missing() == list(range(layout.num_chunks))  # no overwritten byte was kept


_READER = """
import json, time, torch
from tests.transport._model import MODEL, TENANT, make_model
from transport.backend import TransportKind
from transport.layout import Layout
from transport.outcome import FetchStats
from transport.planner import Source
from transport.reader import read_round
from transport.store import HeldVersion
from transport.topology import Topology
layout = Layout.from_tensors(make_model(%d, tiny=200), chunk_size=%d)
dest = HeldVersion.reader(TENANT, MODEL, 1, layout, layout.allocate("cuda"))
stats = FetchStats()
src = Source("ns", "127.0.0.1", %d, transport=TransportKind.IPC, tcp=("127.0.0.1", %d))
r = read_round(TENANT, MODEL, 1, layout, dest, [src], token=b"ok",
               deadline=time.monotonic() + 60, me=Topology(), stats=stats)
print(json.dumps({"done": r.done, "transports": stats.transports, "fallbacks": stats.fallbacks}))
"""


def test_a_reader_in_another_ipc_namespace_falls_back_to_tcp_with_the_reason(
    holder: Holder,
) -> None:
    """What a rollout container started without a shared --ipc sees: a real second IPC
    namespace (`unshare --ipc`, needs root), the same GPU."""
    code = _READER % (SEED, CHUNK, holder.ipc, holder.tcp)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run(
        ["unshare", "--ipc", sys.executable, "-c", code],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if run.returncode != 0 and "unshare" in run.stderr:
        pytest.skip(f"cannot create an IPC namespace here: {run.stderr.strip()[-200:]}")
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["done"]
    assert out["transports"] == {"ns": "tcp"}
    assert "another IPC namespace" in out["fallbacks"]["ns"]
