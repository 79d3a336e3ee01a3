"""How fast the NIXL backend reads 256 MiB from a holder process, under this process's UCX
settings: `python -m tests.transport.nixl_throughput` (docs/nixl.md, "Measured here").

One warm-up read, then `RUNS` timed reads into fresh destinations. "READ" times the NIXL
transfers alone (`NixlChannel._transfer`); "read+verify+commit" the whole `NixlChannel.read`.
A memcpy of the same bytes in the same run gives the scale.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from tests.transport._model import MODEL, TENANT
from tests.transport.nixl_holder_proc import CHUNK, nixl_model
from transport.fetch_state import FetchState
from transport.layout import Layout
from transport.nixl import NixlReader
from transport.nixl.reader import NixlChannel
from transport.planner import Source
from transport.store import HeldVersion

MIB, RUNS = 256, 3


def main() -> None:
    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN"}
    args = [sys.executable, "-m", "tests.transport.nixl_holder_proc", "--mib", str(MIB)]
    proc = subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdin is not None
    port = int(next(line for line in proc.stdout if line.startswith("PORT ")).split()[1])
    src = nixl_model(1, MIB)
    layout = Layout.from_tensors(src, chunk_size=CHUNK)
    publisher = HeldVersion.publisher(TENANT, MODEL, 1, src, layout)
    expected = [publisher.checksum(i) for i in range(layout.num_chunks)]
    spent: list[float] = []
    transfer = NixlChannel._transfer

    def timed(self: NixlChannel, *a: Any) -> None:
        start = time.monotonic()
        transfer(self, *a)
        spent.append(time.monotonic() - start)

    NixlChannel._transfer = timed  # type: ignore[method-assign,assignment]
    reader = NixlReader()
    whole, reads = [], []
    for run in range(RUNS + 1):
        tensors = {k: torch.zeros_like(v) for k, v in src.items()}
        dest = HeldVersion.reader(TENANT, MODEL, 1, layout, tensors)
        spent.clear()
        start = time.monotonic()
        f = FetchState(TENANT, MODEL, 1, dest, b"good", start + 120, 120, expected)
        channel = reader.open(f, Source("holder", "127.0.0.1", port), None)
        outcomes = list(channel.read(range(layout.num_chunks)))
        took = time.monotonic() - start
        channel.close()
        assert dest.complete, {o.status for o in outcomes}
        if run:  # the first read warms the connection
            whole.append(layout.total_bytes / took / 1e9)
            reads.append(layout.total_bytes / sum(spent) / 1e9)
    a = torch.empty(layout.total_bytes, dtype=torch.uint8)
    b = torch.zeros_like(a)
    start = time.monotonic()
    b.copy_(a)
    memcpy = layout.total_bytes / (time.monotonic() - start) / 1e9
    ucx = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("UCX_"))
    print(
        f"{ucx or '(no UCX_*)'}: READ {statistics.median(reads):.2f} GB/s "
        f"(best {max(reads):.2f}); read+verify+commit {statistics.median(whole):.2f} GB/s; "
        f"memcpy {memcpy:.2f} GB/s"
    )
    reader.close()
    proc.stdin.write("exit\n")
    proc.stdin.flush()
    proc.wait(30)


if __name__ == "__main__":
    main()
