"""A trainer in its own process that publishes GPU weights through the SDK, for the CUDA
IPC test of tests/integrations/test_cuda.py (needs a GPU):
`python -m tests.integrations.ipc_trainer_proc HUB TENANT TOKEN`.

Publishes `gpu-ipc@1` (seeded CUDA tensors), prints `READY`, and holds it until stdin closes.
"""

from __future__ import annotations

import sys

import torch

import ros


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"layer.{i}": torch.randn(512, 1024, generator=g) for i in range(4)}


def main() -> None:
    hub, tenant, token = sys.argv[1:4]
    client = ros.connect(hub, tenant=tenant, token=token)
    try:
        on_gpu = {name: t.cuda() for name, t in weights().items()}
        torch.cuda.synchronize()
        published = client.publish("gpu-ipc", 1, on_gpu)
        print("READY", flush=True)
        sys.stdin.read()
        published.release(force=True)
    finally:
        client.close()


if __name__ == "__main__":
    main()
