"""Fixtures for transport tests: in-process holders and holder subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from chaos.holder_faults import Fault
from tests.transport._model import MODEL, TENANT
from tests.transport.open_verifier import allow_all
from transport.layout import Layout
from transport.planner import Source
from transport.server import HolderServer, send_chunk
from transport.store import HeldVersion, HolderStore

ROOT = Path(__file__).resolve().parents[2]

StartHolder = Callable[..., tuple[HolderServer, HolderStore, Source]]


@pytest.fixture
def holders() -> Iterator[StartHolder]:
    """Start in-process holders of given tensors; all stopped at teardown."""
    started: list[HolderServer] = []

    def start(
        tensors: dict[str, torch.Tensor],
        layout: Layout,
        name: str = "h0",
        version: int = 1,
        fault: Fault | None = None,
        verifier: Callable[[str, str, int, bytes], bool] = allow_all,
    ) -> tuple[HolderServer, HolderStore, Source]:
        store = HolderStore()
        store.add(HeldVersion.publisher(TENANT, MODEL, version, tensors, layout))
        server = HolderServer(store, verifier, io_timeout=5, send=fault or send_chunk).start()
        started.append(server)
        return server, store, Source(name, *server.address)

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def spawn_holder() -> Iterator[Callable[..., tuple[subprocess.Popen[str], int]]]:
    """Start holder subprocesses (tests/transport/holder_proc.py); killed at teardown."""
    procs: list[subprocess.Popen[str]] = []

    def spawn(**opts: object) -> subprocess.Popen[str]:
        args = [sys.executable, "-m", "tests.transport.holder_proc"]
        for key, value in opts.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        return proc

    def port_of(proc: subprocess.Popen[str]) -> int:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("PORT "), f"holder did not start: {line!r}"
        return int(line.split()[1])

    def start(**opts: object) -> tuple[subprocess.Popen[str], int]:
        proc = spawn(**opts)
        return proc, port_of(proc)

    start.spawn = spawn  # type: ignore[attr-defined]
    start.port_of = port_of  # type: ignore[attr-defined]
    yield start
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(timeout=10)
