"""A holder process for the failover tests: fetch `model@version`, then serve it slowly (a
delay before every chunk), so a test can SIGKILL it, or a reader, while a reader is
mid-fetch. With `tell`, it prints `sent` after each chunk it served.

usage: python -m tests.engines.vllm_cpu.slow_holder HUB TENANT TOKEN MODEL VERSION DELAY [tell]
"""

from __future__ import annotations

import socket
import sys
import time

import ros
from chaos.holder_faults import Fault
from ros.client.hooks import ClientHooks
from transport.wire import ChunkHeader


class Telling(Fault):
    """A `Fault` that prints `sent` after every chunk (for a test to time a kill by)."""

    def __call__(
        self, conn: socket.socket, header: ChunkHeader, views: list[memoryview], complete: bool
    ) -> None:
        super().__call__(conn, header, views, complete)
        print("sent", flush=True)


def main() -> None:
    hub, tenant, token, model, version, delay = sys.argv[1:7]
    fault = Telling() if sys.argv[7:] == ["tell"] else Fault()  # every chunk goes through it
    client = ros.connect(hub, tenant=tenant, token=token, hooks=ClientHooks(send=fault))
    held = client.fetch(model, int(version), timeout=60)
    fault.chunk_delay = float(delay)  # from now on it serves slowly
    print("ready", client.holder_name, held.version, flush=True)
    time.sleep(300)  # bounded: the test kills it long before


if __name__ == "__main__":
    main()
