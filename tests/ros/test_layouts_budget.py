"""Layout block sets in the tenant's etcd budget, through the SDK and a real hub
(docs/design-notes.md, "Readers in another layout"): the reader that records a block set is
charged for its key, a reader whose tenant's budget cannot take it keeps its bytes and
serves none with nothing written, the charge goes with the version (retention) and with the
model (`DeleteModel`), and a version records at most `MAX_LAYOUTS_PER_VERSION` layouts."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch

import consistency.layouts as layouts_module
import ros
from consistency import Etcd, Keys
from consistency.usage import RECORD_BYTES, Usage
from ros.hub.server import HubServer
from ros.hub.tenants import Quotas, TenantStore
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tests.ros.layout_model import CHUNK, expected, publish_tp, slices_for
from tests.ros.review_state import block_sets_charge, model_charge

Clients = Callable[..., ros.Hub]


@pytest.fixture
def tenant(hub_server: HubServer) -> Iterator[Callable[..., Clients]]:
    """Create a tenant (`quotas`) and return a factory of its clients, closed at the end."""
    opened: list[ros.Hub] = []

    def create(name: str, quotas: Quotas | None = None) -> Clients:
        token = TenantStore(hub_server.etcd, hub_server.keys).create(name, quotas)

        def open_client(**kwargs: object) -> ros.Hub:
            client = ros.connect(hub_server.address, tenant=name, token=token, **kwargs)  # type: ignore[arg-type]
            opened.append(client)
            return client

        return open_client

    yield create
    for client in opened:
        client.close()


def held(hub: HubServer, tenant: str) -> int:
    kv, _ = hub.etcd.get(hub.keys.quota_fence(tenant, "usage"))
    return 0 if kv is None else Usage.decode(kv.value).held


def keys_under(etcd: Etcd, prefix: str) -> list[str]:
    return [bytes(kv.key).decode() for kv in etcd.range(prefix, prefix=True, keys_only=True).kvs]


def charged(hub: HubServer, tenant: str) -> int:
    return model_charge(hub.etcd, hub.keys, tenant, "policy", 5.0)


def publish_whole(trainer: ros.Hub, version: int) -> None:
    weights = expected(0, 1)
    trainer.publish(
        "policy", version, {k: v.contiguous() for k, v in weights.items()}, chunk_size=CHUNK
    )


def test_a_recorded_block_set_is_charged_and_given_back_with_its_version_and_model(
    hub_server: HubServer, tenant: Callable[..., Clients]
) -> None:
    clients = tenant("lb-charge")
    trainer = clients()
    publish_whole(trainer, 1)
    published = held(hub_server, "lb-charge")
    assert published == charged(hub_server, "lb-charge") > 0
    assert clients().fetch_slices("policy", 1, slices=slices_for(0, 2)[1], layout="tp2").served
    keys: Keys = hub_server.keys
    listed = keys_under(hub_server.etcd, keys.model_layouts("lb-charge", "policy"))
    (block_set,) = [k for k in listed if "/s/" in k]
    value, _ = hub_server.etcd.get(block_set)
    assert value is not None
    one = len(value.value) + RECORD_BYTES
    assert held(hub_server, "lb-charge") == published + one == charged(hub_server, "lb-charge")
    # A second holder of the same blocks records nothing more: no second charge.
    assert clients().fetch_slices("policy", 1, slices=slices_for(0, 2)[1], layout="tp2").served
    assert held(hub_server, "lb-charge") == published + one

    for version in (2, 3):  # the hub retains the newest 2: policy@1 is retired
        publish_whole(trainer, version)
    prefix = keys.version_layouts("lb-charge", "policy", 1)
    deadline = time.monotonic() + 15
    while hub_server.etcd.count(prefix):
        assert time.monotonic() < deadline, "policy@1's layout keys outlived it"
        time.sleep(0.2)
    assert block_sets_charge(hub_server.etcd, keys, "lb-charge", "policy", 5.0) == 0
    assert held(hub_server, "lb-charge") == charged(hub_server, "lb-charge")

    assert clients().fetch_slices("policy", 3, slices=slices_for(1, 2)[1], layout="tp2").served
    assert block_sets_charge(hub_server.etcd, keys, "lb-charge", "policy", 5.0) > 0
    assert held(hub_server, "lb-charge") == charged(hub_server, "lb-charge")
    trainer._rpc("DeleteModel", pb.DeleteModelRequest(model="policy"))
    assert held(hub_server, "lb-charge") == 0
    assert keys_under(hub_server.etcd, keys.model_layouts("lb-charge", "policy")) == []


def test_a_reader_whose_budget_cannot_take_its_block_set_keeps_its_bytes_and_writes_nothing(
    hub_server: HubServer, tenant: Callable[..., Clients]
) -> None:
    probe = tenant("lb-probe")
    publish_tp(probe, 2)
    published = held(hub_server, "lb-probe")
    # Room for the same publish and one record more: less than any block set's key.
    clients = tenant("lb-tight", Quotas(max_etcd_bytes=published + RECORD_BYTES))
    publish_tp(clients, 2)
    assert held(hub_server, "lb-tight") == published
    out, slices = slices_for(1, 2)
    got = clients().fetch_slices("policy", 1, slices=slices, layout="tp2", timeout=30)
    for name, tensor in expected(1, 2).items():
        assert torch.equal(out[name], tensor), name
    assert not got.served
    assert keys_under(hub_server.etcd, hub_server.keys.model_layouts("lb-tight", "policy")) == []
    assert held(hub_server, "lb-tight") == published


def test_a_layout_past_the_versions_bound_is_read_but_not_served(
    hub_server: HubServer, tenant: Callable[..., Clients], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(layouts_module, "MAX_LAYOUTS_PER_VERSION", 1)  # the hub's, here
    clients = tenant("lb-layouts")
    publish_tp(clients, 2)
    assert clients().fetch_slices("policy", 1, slices=slices_for(0, 2)[1], layout="tp2").served
    out, slices = slices_for(3, 4)
    got = clients().fetch_slices("policy", 1, slices=slices, layout="tp4", timeout=30)
    for name, tensor in expected(3, 4).items():
        assert torch.equal(out[name], tensor), name
    assert not got.served
    keys = hub_server.keys
    assert keys_under(hub_server.etcd, keys.layout("lb-layouts", "policy", 1, "tp4")) == []
    assert held(hub_server, "lb-layouts") == charged(hub_server, "lb-layouts")
