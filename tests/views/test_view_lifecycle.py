"""A view goes with its version (docs/views.md, "Views as versions"): retention collects a
model's views with its versions whatever the publish that runs it carries, and deleting a
model deletes its views, their delta companions included, in the same transaction, against
a real hub over a real etcd."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

import ros
from consistency.deletion import delete_model
from consistency.usage import Usage
from ros.hub.server import HubServer
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.view_rules import views_of
from tests.views.test_publish_views import FORMATS, llama


def _held_bytes(hub_server: HubServer, tenant: str) -> int:
    kv, _ = hub_server.etcd.get(hub_server.keys.quota_fence(tenant, "usage"))
    assert kv is not None
    return Usage.decode(kv.value).held


def _listed(client: ros.Hub) -> dict[str, list[int]]:
    return {m.name: list(m.versions) for m in client.list_models()}


def test_a_publish_without_views_collects_the_views_of_the_versions_it_retires(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    """Retention keeps the newest 2 versions (the hub's default): v1 and v2 carry views,
    v3 and v4 do not; the views of v1 and v2 go when their versions go, with their bytes."""
    trainer = connect("views-keep")
    pubs = [trainer.publish("policy", v, llama(v), views=FORMATS) for v in (1, 2)]
    with_views = _held_bytes(hub_server, "views-keep")
    pubs += [trainer.publish("policy", v, llama(v)) for v in (3, 4)]
    for pub in pubs:
        pub.release(force=True)
    expected = {"policy": [3, 4], "policy.fp8-block128": [], "policy.mxfp8": []}
    deadline = time.monotonic() + 20
    while (listed := _listed(trainer)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert listed == expected
    for fmt in FORMATS:
        for version in (1, 2):
            with pytest.raises(ros.VersionNotFound):
                trainer.inspect(f"policy.{fmt}", version)
    # what is held is v3 and v4 alone, each the size of a version without views
    plain = _held_bytes(hub_server, "views-keep")
    assert 0 < plain < with_views


def test_deleting_a_model_deletes_its_views_and_their_companions_in_one_transaction(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    trainer = connect("views-del")
    weights = llama(1)
    first = trainer.publish("policy", 1, weights, views=FORMATS, delta=True)
    step = {k: v.clone() for k, v in weights.items()}
    step["model.layers.0.self_attn.q_proj.weight"][:4] += 0.001  # a small step: a delta
    second = trainer.publish("policy", 2, step, views=FORMATS, delta=True)
    companion = "policy.fp8-block128.delta"
    assert companion in views_of("policy")
    names = {m.name for m in trainer.list_models()}
    assert {"policy", "policy.fp8-block128", "policy.mxfp8", companion} <= names
    for pub in (first, second):
        pub.release(force=True)
    done = trainer._rpc("DeleteModel", pb.DeleteModelRequest(model="policy"))
    assert done.versions_deleted == 2
    # one transaction: every view key was deleted at the revision of the model's
    prefixes = [
        hub_server.keys.model("views-del", m)
        for m in ("policy", "policy.delta", *views_of("policy"))
    ]
    for prefix in prefixes:
        kv, _ = hub_server.etcd.get(prefix + "latest")
        assert kv is None
    assert {m.name for m in trainer.list_models()} == set()  # its own companion went too
    assert trainer.latest("policy.delta") == 0
    for fmt in FORMATS:
        assert trainer.latest(f"policy.{fmt}") == 0
        with pytest.raises(ros.VersionNotFound):
            trainer.fetch("policy", 1, view=fmt, timeout=5)
    assert trainer.latest(companion) == 0
    # published again from version 1, without views: no view of the old model answers
    trainer.publish("policy", 1, weights).release(force=True)
    with pytest.raises(ros.VersionNotFound):
        trainer.fetch("policy", 1, view="mxfp8", timeout=5)


def test_deleting_a_model_with_only_views_left_deletes_them_and_a_view_has_none(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    """Keys of views alone count as the model's (nothing else left of it), and deleting a
    view model deletes nothing of its model (a view has no views)."""
    trainer = connect("views-only")
    trainer.publish("policy", 1, llama(1), views=("mxfp8",)).release(force=True)
    etcd, keys = hub_server.etcd, hub_server.keys
    delete_model(etcd, keys, "views-only", "policy.mxfp8")
    assert views_of("policy.mxfp8") == []
    assert trainer.latest("policy") == 1
    trainer.publish("policy", 2, llama(2), views=("mxfp8",)).release(force=True)
    etcd.delete(keys.model("views-only", "policy"), prefix=True)  # only the view is left
    etcd.delete(keys.model_pages("views-only", "policy"), prefix=True)
    gone = delete_model(etcd, keys, "views-only", "policy")
    assert gone.versions == 0
    assert trainer.latest("policy.mxfp8") == 0
    with pytest.raises(ros.VersionNotFound):
        delete_model(etcd, keys, "views-only", "policy")
