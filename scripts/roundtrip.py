"""A hub round trip with nothing but the installed tensorhub: an embedded etcd, a hub, a
tenant, one publish and one fetch by another client, the bytes compared.

CI runs it where the repository's packages cannot shadow the installed ones (a script's own
folder, not the working directory, is first on sys.path): against the built wheel, in the
environment of the lowest direct versions, and in each engine's environment
(scripts/check-install.sh). It prints what it imported from where, and exits non-zero on any
failure.
"""

from __future__ import annotations

import sys

import torch

import ros
from consistency import EtcdCluster
from ros.hub.server import HubServer
from ros.hub.tenants import TenantStore


def main() -> int:
    import google.protobuf
    import grpc

    print(
        f"tensorhub from {ros.__file__}; grpcio {grpc.__version__}, "
        f"protobuf {google.protobuf.__version__}, torch {torch.__version__}"
    )
    weights = {
        "embed.weight": torch.randn(256, 64).to(torch.bfloat16),
        "head.weight": torch.randn(64, 256),
        "step": torch.tensor(7, dtype=torch.int64),
    }
    with EtcdCluster(size=1) as cluster:
        server = HubServer(cluster.endpoints, admin_token="roundtrip").start()
        try:
            token = TenantStore(server.etcd, server.keys).create("roundtrip")
            with (
                ros.connect(server.address, tenant="roundtrip", token=token) as trainer,
                ros.connect(server.address, tenant="roundtrip", token=token) as rollout,
            ):
                published = trainer.publish("policy", 1, weights)
                held = rollout.fetch("policy", "latest", timeout=60)
                wrong = [n for n, t in weights.items() if not torch.equal(held.tensors[n], t)]
                if held.version != 1 or wrong:
                    print(f"round trip FAILED: version {held.version}, differing {wrong}")
                    return 1
                held.release(force=True)
                published.release()
        finally:
            server.stop(grace=0.2)
    print(f"round trip ok: {len(weights)} tensors published and fetched through a hub")
    return 0


if __name__ == "__main__":
    sys.exit(main())
