"""Views published with their version and fetched by name (docs/views.md), against a real
hub over a real etcd, with real clients serving each other over sockets."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

import ros
from consistency.events import EventKind
from consistency.usage import RECORD_BYTES, Usage
from ros.hub.server import HubServer
from ros.hub.tenants import Quotas, TenantStore
from ros.hub.views import check_pages, check_shard_pages
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.views import make_view
from tensorhub.errors import ManifestTooLarge

FORMATS = ("fp8-block128", "mxfp8")


def llama(seed: int) -> dict[str, torch.Tensor]:
    """A two-layer Llama-shaped state dict in bf16: linear weights (quantized by a view),
    an embedding, norms and `lm_head` (kept)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    out = {"model.embed_tokens.weight": w(256, 128)}
    for i in range(2):
        p = f"model.layers.{i}."
        for name, shape in {
            "self_attn.q_proj": (128, 128), "self_attn.k_proj": (64, 128),
            "self_attn.v_proj": (64, 128), "self_attn.o_proj": (128, 128),
            "mlp.gate_proj": (256, 128), "mlp.up_proj": (256, 128), "mlp.down_proj": (128, 256),
        }.items():  # fmt: skip
            out[p + name + ".weight"] = w(*shape)
        out[p + "input_layernorm.weight"] = torch.ones(128, dtype=torch.bfloat16)
    out["model.norm.weight"] = torch.ones(128, dtype=torch.bfloat16)
    out["lm_head.weight"] = w(256, 128)
    return out


def same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return got.keys() == expected.keys() and all(
        got[k].dtype == expected[k].dtype
        and torch.equal(got[k].view(torch.uint8), expected[k].view(torch.uint8))
        for k in got
    )


def test_views_are_versions_of_their_own_fetched_by_name_and_served_by_readers(
    connect: Callable[..., ros.Hub],
) -> None:
    trainer, first, second = connect(), connect(), connect()
    weights = llama(1)
    pub = trainer.publish("policy", 1, weights, views=FORMATS)
    assert sorted(pub.views) == sorted(FORMATS)
    assert pub.views["fp8-block128"].model == "policy.fp8-block128"
    base = trainer.inspect("policy", 1)
    for fmt in FORMATS:
        info = trainer.inspect(f"policy.{fmt}", 1)
        assert info.published_revision == base.published_revision  # one transaction
        assert info.manifest.metadata["tensorhub.view"] == fmt
        assert info.manifest.metadata["tensorhub.view-of"] == "policy"
        assert trainer.latest(f"policy.{fmt}") == 1
    names = {m.name for m in trainer.list_models()}
    assert names == {"policy", "policy.fp8-block128", "policy.mxfp8"}

    expected, _ = make_view(weights, "fp8-block128")
    held = first.fetch("policy", 1, view="fp8-block128", timeout=30)
    assert same(held.tensors, expected)
    assert held.tensors["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert held.tensors["lm_head.weight"].dtype == torch.bfloat16
    assert set(held.stats.bytes_per_source) == {trainer.holder_name}
    holders = {h.holder for h in trainer.holders("policy.fp8-block128", 1)}
    assert holders == {trainer.holder_name, first.holder_name}
    assert {h.holder for h in trainer.holders("policy", 1)} == {trainer.holder_name}

    pub.release(force=True)  # the version and its views: the trainer serves none of them
    assert all(view.released for view in pub.views.values())
    assert {h.holder for h in trainer.holders("policy.fp8-block128", 1)} == {first.holder_name}
    again = second.fetch("policy", 1, view="fp8-block128", timeout=30)
    assert same(again.tensors, expected)
    assert set(again.stats.bytes_per_source) == {first.holder_name}  # a reader served it


def test_a_watcher_never_sees_a_version_without_its_view(connect: Callable[..., ros.Hub]) -> None:
    trainer, watcher = connect(), connect()
    trainer.publish("policy", 1, llama(0), views=("mxfp8",)).release(force=True)
    seen: list[tuple[int, int]] = []
    with watcher.watch("policy", versions_only=True) as events:
        for version in range(2, 6):
            trainer.publish("policy", version, llama(version), views=("mxfp8",))
            deadline = time.monotonic() + 20
            while len(seen) < version - 1 and time.monotonic() < deadline:
                event = events.get(deadline - time.monotonic())
                if event is None or event.kind is not EventKind.VERSION_PUBLISHED:
                    continue
                # the view is there as soon as its version is seen, at the same revision
                info = watcher.inspect("policy.mxfp8", event.version)
                seen.append((event.version, event.revision))
                assert info.published_revision == event.revision
    assert [v for v, _ in seen] == [2, 3, 4, 5]
    with watcher.watch("policy.mxfp8", versions_only=True, since=seen[0][1]) as events:
        got = []
        deadline = time.monotonic() + 20
        while len(got) < 4 and time.monotonic() < deadline:
            event = events.get(deadline - time.monotonic())
            if event is not None and event.kind is EventKind.VERSION_PUBLISHED:
                got.append((event.version, event.revision))
    assert [v for v, _ in got] == [2, 3, 4, 5]
    assert [r for _, r in got] == [r for _, r in seen]  # each view at its version's revision


def test_a_refused_view_refuses_its_version_too(hub_server: HubServer) -> None:
    """The model quota counts views: a version whose view would pass it is not published
    either (one transaction), and nothing of it is left."""
    token = TenantStore(hub_server.etcd, hub_server.keys).create("views-q", Quotas(max_models=2))
    with ros.connect(hub_server.address, tenant="views-q", token=token) as client:
        with pytest.raises(ros.QuotaExceeded, match="models of tenant views-q"):
            client.publish("policy", 1, llama(0), views=FORMATS)  # 3 models, quota 2
        assert client.latest("policy") == 0
        assert client.list_models() == []
        pub = client.publish("policy", 1, llama(0), views=("mxfp8",))  # 2 models: fits
        assert {m.name for m in client.list_models()} == {"policy", "policy.mxfp8"}
        with pytest.raises(ros.QuotaExceeded):
            client.publish("policy", 2, llama(0), views=FORMATS)
        assert client.latest("policy") == 1
        assert client.latest("policy.mxfp8") == 1
        pub.release(force=True)


def _held_bytes(hub_server: HubServer, tenant: str) -> int:
    kv, _ = hub_server.etcd.get(hub_server.keys.quota_fence(tenant, "usage"))
    assert kv is not None
    return Usage.decode(kv.value).held


def test_retention_collects_a_view_with_its_version_and_gives_its_bytes_back(
    hub_server: HubServer, connect: Callable[..., ros.Hub]
) -> None:
    trainer = connect("views-r")
    pubs = [trainer.publish("policy", 1, llama(1), views=FORMATS)]
    one = _held_bytes(hub_server, "views-r")
    sizes = [len(trainer.inspect(m, 1).manifest.SerializeToString())
             for m in ("policy", "policy.fp8-block128", "policy.mxfp8")]  # fmt: skip
    assert one == sum(sizes) + 3 * RECORD_BYTES  # the version and its two views
    for version in range(2, 5):
        pubs.append(trainer.publish("policy", version, llama(version), views=FORMATS))
    for pub in pubs:
        pub.release(force=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        listed = {m.name: list(m.versions) for m in trainer.list_models()}
        if all(v == [3, 4] for v in listed.values()) and len(listed) == 3:
            break
        time.sleep(0.05)
    assert listed == {"policy": [3, 4], "policy.fp8-block128": [3, 4], "policy.mxfp8": [3, 4]}
    with pytest.raises(ros.VersionNotFound):
        trainer.inspect("policy.fp8-block128", 2)
    assert _held_bytes(hub_server, "views-r") == 2 * one  # v3 and v4, views and all


def test_bad_view_names_are_refused_with_named_errors(connect: Callable[..., ros.Hub]) -> None:
    client = connect()
    weights = llama(0)
    with pytest.raises(ros.InvalidArgument, match="not a view format"):
        client.publish("policy", 1, weights, views=("fp9",))
    with pytest.raises(ros.InvalidArgument, match="a sequence of formats"):
        client.publish("policy", 1, weights, views="mxfp8")  # type: ignore[arg-type]
    with pytest.raises(ros.InvalidArgument, match="asked for twice"):
        client.publish("policy", 1, weights, views=("mxfp8", "mxfp8"))
    with pytest.raises(ros.InvalidArgument, match="model-parallel"):
        client.publish("policy", 1, weights, shard=(0, 2), views=("mxfp8",))
    with pytest.raises(ros.InvalidName, match="reserved for views"):
        client.publish("policy.mxfp8", 1, weights)  # refused by the hub
    with pytest.raises(ros.InvalidName, match="is a view"):
        client.publish("policy.mxfp8", 1, weights, views=("fp8-block128",))
    assert client.list_models() == []
    client.publish("policy", 1, weights, views=("mxfp8",))
    with pytest.raises(ros.InvalidArgument, match="not a view format"):
        client.fetch("policy", 1, view="fp8")
    with pytest.raises(ros.VersionNotFound):
        client.fetch("policy", 1, view="fp8-block128", timeout=10)  # never published


def test_views_whose_pages_would_pass_one_transaction_are_refused_before_any_write() -> None:
    """etcd's --max-txn-ops (128) bounds a version's and its views' manifest pages
    together: past it, `ManifestTooLarge` naming the count, not etcd's refusal."""
    big = bytes(45 << 20)  # 45 pages of 1 MiB
    check_pages(40 << 20, [("policy.mxfp8", big)])  # 85 pages: fits
    with pytest.raises(ManifestTooLarge, match="130 pages"):
        check_pages(40 << 20, [("policy.mxfp8", big), ("policy.fp8-block128", big)])


def test_a_view_published_with_delta_is_read_as_a_delta_into_the_view_before(
    connect: Callable[..., ros.Hub],
) -> None:
    """`delta=True` with views: each view is encoded against the publisher's copy of its
    previous view (its fp8 bytes and scales), and a reader holding that view reads only the
    encoded changes; the result is the view of the new weights, bit for bit."""
    trainer, reader = connect(), connect()
    first = llama(1)
    trainer.publish("policy", 1, first, views=("fp8-block128",), delta=True)
    held = reader.fetch("policy", 1, view="fp8-block128", timeout=30)
    second = {k: v.clone() for k, v in first.items()}
    for name, tensor in second.items():  # a small step: a few weights move
        if name.endswith("q_proj.weight"):
            tensor[:4] += 0.001
    pub = trainer.publish("policy", 2, second, views=("fp8-block128",), delta=True)
    own = pub.views["fp8-block128"].companion
    assert own is not None
    assert own.model == "policy.fp8-block128.delta"
    info = trainer.inspect("policy.fp8-block128", 2)
    assert info.manifest.delta.base == 1
    tensors = held.tensors
    held.release()
    again = reader.fetch("policy", 2, view="fp8-block128", into=tensors, timeout=30)
    assert again.delta is not None
    assert again.delta.base == 1
    assert again.delta.chunks > 0
    expected, _ = make_view(second, "fp8-block128")
    assert same(again.tensors, expected)
    pub.release(force=True)
    assert own.released  # the view's companion goes with the view


def test_a_view_model_is_deleted_as_any_model(connect: Callable[..., ros.Hub]) -> None:
    """`DeleteModel` (`tensorhub delete`) of a view model: its versions go, its version's
    stay, and the next publish with that view creates it again."""
    trainer = connect()
    trainer.publish("policy", 1, llama(0), views=("mxfp8",)).release(force=True)
    trainer._rpc("DeleteModel", pb.DeleteModelRequest(model="policy.mxfp8"))
    assert {m.name for m in trainer.list_models()} == {"policy"}
    pub = trainer.publish("policy", 2, llama(1), views=("mxfp8",))
    assert trainer.latest("policy.mxfp8") == 2
    pub.release(force=True)


def test_a_shards_view_pages_past_one_batch_are_refused_before_any_write() -> None:
    """A shard's manifest pages and its view shards' must fit one batch's transaction by
    themselves (`check_shard_pages`): past it, `ManifestTooLarge` naming the count."""
    big = bytes(45 << 20)  # 45 pages of 1 MiB
    check_shard_pages(40 << 20, [("policy.mxfp8", big)])  # 85 pages: fits
    with pytest.raises(ManifestTooLarge, match="130 pages"):
        check_shard_pages(40 << 20, [("policy.mxfp8", big), ("policy.fp8-block128", big)])
