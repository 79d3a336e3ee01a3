"""etcd requests per publish and per fetch, counted on etcd's side (its own `/metrics`).

A hub wrapper that counted calls could be bypassed by new code; etcd's
`grpc_server_handled_total` counts every unary KV request it answered, whoever sent it. The
hub, one publisher and one reader run in this process against an etcd of this test's own,
so nothing else talks to it; the figures are printed (`-s`) and bounded.
"""

from __future__ import annotations

import re
import statistics
import urllib.request
from collections.abc import Iterator

import pytest
import torch

import ros
from consistency import EtcdCluster, Keys
from ros.hub.server import HubServer
from ros.hub.tenants import Quotas, TenantStore

ROUNDS = 12
KV_CALL = re.compile(
    r'^grpc_server_handled_total\{grpc_code="[A-Za-z]+",grpc_method="(Range|Txn|Put|DeleteRange)",'
    r'grpc_service="etcdserverpb\.KV",grpc_type="unary"\} ([0-9.e+]+)$',
    re.MULTILINE,
)


def kv_requests(cluster: EtcdCluster) -> int:
    """Every unary KV request etcd has answered so far (Range, Txn, Put, DeleteRange)."""
    url = f"http://{cluster.endpoints[0]}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return int(sum(float(value) for _, value in KV_CALL.findall(text)))


@pytest.fixture
def own_etcd() -> Iterator[EtcdCluster]:
    with EtcdCluster(size=1) as cluster:
        yield cluster


def _weights(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((256,), float(step)), "b": torch.arange(16.0) + step}


@pytest.mark.timeout(120)
def test_etcd_requests_per_publish_and_per_fetch(own_etcd: EtcdCluster) -> None:
    """A whole-version publish is 3 requests: read `latest`, the transaction (the session
    is a compare in it, the budget a cached read), and retention's scan of the model's
    versions, which finds nothing to collect (`retain` is past the rounds). A fetch of a new
    version is 2: the PARTIAL registration and the COMPLETE update, one transaction each
    (its header and manifest are in the hub's cache since the publish; the COMPLETE compares
    the record's value instead of reading it first). A forced release is 1 transaction.
    (Before: 5 and 3.) Each is the median over the rounds: etcd counts
    every request, and a background one (retention's scan landing after its publish
    answered, a read-key rotation) may fall into a round's window."""
    keys = Keys("/count")
    server = HubServer(
        own_etcd.endpoints, admin_token="admin", keys=keys, retain=2 * ROUNDS
    ).start()
    counts: dict[str, list[int]] = {"publish": [], "fetch": [], "release": []}
    try:
        quotas = Quotas(max_retained_versions=2 * ROUNDS)
        token = TenantStore(server.etcd, keys).create("team", quotas)
        trainer = ros.connect(server.address, tenant="team", token=token)
        reader = ros.connect(server.address, tenant="team", token=token)
        try:
            # Warm: the model exists, sessions are open, every cache that may fill has.
            trainer.publish("policy", 1, _weights(1))
            reader.fetch("policy", 1, timeout=30).release(force=True)
            for step in range(2, 2 + ROUNDS):
                start = kv_requests(own_etcd)
                trainer.publish("policy", step, _weights(step))
                published = kv_requests(own_etcd)
                held = reader.fetch("policy", step, timeout=30)
                fetched = kv_requests(own_etcd)
                held.release(force=True)
                counts["publish"].append(published - start)
                counts["fetch"].append(fetched - published)
                counts["release"].append(kv_requests(own_etcd) - fetched)
        finally:
            reader.close()
            trainer.close()
    finally:
        server.stop(grace=0.2)
    print("\netcd KV requests per call, median (mean, max) over the rounds:")
    for name, seen in counts.items():
        print(f"  {name}: {statistics.median(seen):g} ({statistics.mean(seen):.2f}, {max(seen)})")
    assert statistics.median(counts["publish"]) <= 3
    assert statistics.median(counts["fetch"]) <= 2
    assert statistics.median(counts["release"]) <= 1
