"""A holder process for the failover tests: fetch `model@version`, then serve it slowly (a
delay before every chunk), so a test can SIGKILL it while a reader is mid-fetch.

usage: python -m tests.engines.vllm_cpu.slow_holder HUB TENANT TOKEN MODEL VERSION DELAY
"""

from __future__ import annotations

import sys
import time

import ros
from chaos.holder_faults import Fault
from ros.client.hooks import ClientHooks


def main() -> None:
    hub, tenant, token, model, version, delay = sys.argv[1:7]
    fault = Fault()  # the holder server sends every chunk through it
    client = ros.connect(hub, tenant=tenant, token=token, hooks=ClientHooks(send=fault))
    held = client.fetch(model, int(version), timeout=60)
    fault.chunk_delay = float(delay)  # from now on it serves slowly
    print("ready", client.holder_name, held.version, flush=True)
    time.sleep(300)  # bounded: the test kills it long before


if __name__ == "__main__":
    main()
