"""The SDK routes each holder over the best transport both sides have (issue 13, item 1).

A client advertises every transport it serves (`rdma` only where `rdma_available()`); a
reader picks per holder rdma → (CUDA IPC, a later issue) → tcp and says why it fell back.
On CPU: a record advertising rdma and tcp is read over tcp by this device-less reader, with
the fallback reason in `FetchStats`; a record advertising only rdma is skipped with the
reason while the fetch succeeds from a tcp holder. With a device, a fetch runs over RDMA
end to end; here that test is skipped with the probe's reason. No device is faked: the
rdma endpoints below are records, as a holder with a device would write them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch

import ros
from consistency.records import HolderRecord, HolderState
from ros.hub.server import HubServer
from tests.ros.helpers import make_model
from tests.waiting import wait_until
from transport.rdma import rdma_available, rdma_unavailable_reason

needs_rdma = pytest.mark.skipif(
    not rdma_available(), reason=f"needs an RDMA device: {rdma_unavailable_reason()}"
)
no_rdma = pytest.mark.skipif(rdma_available(), reason="this machine has a usable RDMA device")


def _plant(
    server: HubServer, owner: ros.Hub, model: str, version: int, name: str,
    endpoints: dict[str, str],
) -> None:  # fmt: skip
    """A COMPLETE holder record with these endpoints, in `owner`'s session."""
    record = HolderRecord(
        holder=name,
        endpoints=endpoints,
        state=HolderState.COMPLETE,
        session=owner.session.id,
    )
    key = server.keys.holder(owner.tenant, model, version, name)
    server.etcd.put(key, record.encode(), lease=owner.session.id, timeout=10)


def test_a_client_advertises_the_transports_it_serves(
    connect: Callable[..., ros.Hub],
) -> None:
    trainer, reader = connect(), connect()
    trainer.publish("policy", 1, make_model(1))
    (record,) = reader.inspect("policy", 1).holders
    expected = {"tcp", "rdma"} if rdma_available() else {"tcp"}
    assert set(record.endpoints) == expected


@no_rdma
def test_a_dual_record_is_read_over_tcp_with_the_fallback_reason(
    hub_server: HubServer, connect: Callable[..., ros.Hub], caplog: pytest.LogCaptureFixture
) -> None:
    trainer, bystander, reader = connect(), connect(), connect()
    model = make_model(2)
    trainer.publish("policy", 1, model)
    (own,) = reader.inspect("policy", 1).holders
    tcp = own.endpoints["tcp"]
    # The same bytes behind a record that also offers RDMA (as a holder with a device writes
    # it); the trainer's own record goes, so the dual one is the reader's only source.
    _plant(hub_server, bystander, "policy", 1, "dual", {"rdma": "127.0.0.1:9", "tcp": tcp})
    hub_server.etcd.delete(hub_server.keys.holder(trainer.tenant, "policy", 1, own.name),
                           timeout=10)  # fmt: skip
    wait_until(
        "the hub lists only the dual record",
        lambda: [h.name for h in reader.inspect("policy", 1).holders] == ["dual"],
    )
    with caplog.at_level(logging.INFO, logger="ros.client.orchestrator"):
        held = reader.fetch("policy", 1, timeout=30)
    for name, tensor in model.items():
        assert torch.equal(held.tensors[name], tensor)
    assert "reading holder dual over tcp: rdma: no RDMA here" in caplog.text
    assert held.stats.transports == {"dual": "tcp"}
    assert rdma_unavailable_reason() in held.stats.fallbacks["dual"]
    assert held.stats.fallbacks["dual"].startswith("rdma: no RDMA here")


@no_rdma
def test_an_rdma_only_record_is_skipped_with_the_reason_and_tcp_serves(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    trainer, bystander, reader = connect(), connect(), connect()
    model = make_model(3)
    trainer.publish("policy", 1, model)
    _plant(hub_server, bystander, "policy", 1, "rdma-only", {"rdma": "127.0.0.1:9"})
    wait_until(
        "the hub lists both records",
        lambda: len(reader.inspect("policy", 1).holders) == 2,
    )
    held = reader.fetch("policy", 1, timeout=30)
    for name, tensor in model.items():
        assert torch.equal(held.tensors[name], tensor)
    assert set(held.stats.bytes_per_source) == {trainer.holder_name}
    assert held.stats.transports == {trainer.holder_name: "tcp"}
    why = held.stats.failed_sources["rdma-only"]
    assert why.startswith("skipped: no transport this reader can use"), why
    assert rdma_unavailable_reason() in why


@needs_rdma
@pytest.mark.rdma
def test_a_fetch_between_two_clients_with_devices_runs_over_rdma(
    connect: Callable[..., ros.Hub],
) -> None:
    trainer, reader = connect(), connect()
    model = make_model(4)
    trainer.publish("policy", 1, model)
    held = reader.fetch("policy", 1, timeout=60)
    for name, tensor in model.items():
        assert torch.equal(held.tensors[name], tensor)
    assert held.stats.transports == {trainer.holder_name: "rdma"}
    assert held.stats.fallbacks == {}
