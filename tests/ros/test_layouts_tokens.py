"""A read from a layout's holders outlives its read token, with a real hub over real etcd:
the hub issues read tokens for `TTL` seconds, the holder sends each chunk after a pause,
so the read takes over two token lifetimes; the token is renewed (ros.client.read_token)
and every byte still comes from the holder, none from the trainer."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

import ros
from chaos.holder_faults import Fault
from consistency import EtcdCluster, Keys
from ros.client.hooks import ClientHooks
from ros.hub.server import HubServer
from ros.hub.tenants import TenantStore
from tests.ros.conftest import ADMIN
from transport import fetch_state

TTL = 3.0  # seconds a read token lives here
CHUNK = 64 * 1024
DELAY = 1.0  # the layout holder's pause before each chunk
N = 24 * CHUNK // 4  # float32 elements: 24 chunks, 4 GETs in flight: about 6 s


@pytest.fixture
def short_tokens(etcd_cluster: EtcdCluster, keys: Keys) -> Iterator[HubServer]:
    server = HubServer(
        etcd_cluster.endpoints, admin_token=ADMIN, keys=keys, read_token_ttl=TTL
    ).start()
    yield server
    server.stop(grace=0.2)


@pytest.fixture
def clients(short_tokens: HubServer) -> Iterator[Callable[..., ros.Hub]]:
    token = TenantStore(short_tokens.etcd, short_tokens.keys).create("team-a")
    opened: list[ros.Hub] = []

    def open_client(**kwargs: object) -> ros.Hub:
        client = ros.connect(short_tokens.address, tenant="team-a", token=token, **kwargs)  # type: ignore[arg-type]
        opened.append(client)
        return client

    yield open_client
    for client in opened:
        client.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_read_from_layout_holders_renews_its_token(
    clients: Callable[..., ros.Hub], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetch_state, "BATCH_BYTES", CHUNK)  # one chunk per GET
    weights = {"w": torch.randn(N, generator=torch.Generator().manual_seed(3))}
    trainer = clients()
    trainer.publish("policy", 1, weights, chunk_size=CHUNK)
    slow = clients(hooks=ClientHooks(send=Fault(chunk_delay=DELAY)))
    first = torch.empty(N)
    slow.fetch_slices("policy", 1, slices={"w": ros.Slice(first, (0,), (N,))}, layout="whole")
    out = torch.empty(N)
    got = clients().fetch_slices(
        "policy", 1, slices={"w": ros.Slice(out, (0,), (N,))}, layout="whole", timeout=40,
        rate_floor=0,
    )  # fmt: skip
    assert torch.equal(out, weights["w"])
    assert got.from_trainer == set()
    assert got.bytes_per_source == {slow.holder_name: N * 4}
