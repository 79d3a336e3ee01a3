"""The scale bench's harness at N=20: the ceiling server and the hub each reach every
client with every version, and the round reports no error (real processes, real sockets)."""

from __future__ import annotations

from typing import Any

from bench.scale.load import RoundSpec
from bench.scale.sessions import ceiling_round, hub_round
from consistency import EtcdCluster

SPEC = RoundSpec(
    clients=20, versions=3, gap=0.05, workers=2, connect_seconds=30.0, seen_seconds=10.0
)


def _clean(r: dict[str, Any]) -> None:
    assert "failed" not in r, r.get("failed")
    assert r["sessions"] == 20
    assert r["versions_published"] == 3
    assert r["versions_missing_somewhere"] == 0
    assert r["deliveries"] == r["deliveries_expected"] == 60
    assert r["stream_errors"] == {}
    assert r["latest_errors"] == {}
    assert r["latest_calls"] > 0
    assert r["threads"] > 0
    assert r["rss_mb"] > 0


def test_ceiling_round_reaches_every_client() -> None:
    _clean(ceiling_round(SPEC, lambda _: None))


def test_hub_round_reaches_every_client(etcd_cluster: EtcdCluster) -> None:
    _clean(hub_round(etcd_cluster.endpoints, SPEC, lambda _: None))


def test_shards_bursts_smoke() -> None:
    """Both shard bursts over two replicas (ranks alternate them): the replies that say
    visible all come from the one transaction that moved Latest, Latest moves with the last
    shard and not before, every revision is counted."""
    from bench.scale import shards

    out = shards.run(
        shards=8, ranks=6, inflight=4, replicas=(2,), workers=2, singles=2, sequential=8,
        group_tensors=4,
    )  # fmt: skip
    assert [(c["case"], c["replicas"]) for c in out["cases"]] == [
        (case, 2) for case in shards.CASES
    ]
    assert set(shards.CASES) == {"ranks", "inflight", "sequential", "group-shards", "group-ranks"}
    for case in out["cases"]:
        assert case["ok"], case
        if case["case"].startswith("group-"):  # the busiest thread is one of the process's
            assert 0.0 <= case["hub_loop_cpu_s"] <= case["hub_cpu_s"] + 0.05, case
            assert case["hub_children_cpu_s"] >= 0.0, case  # its checking processes'
            # the other processes of the call: the sender and etcd (it wrote the batches)
            assert case["client_cpu_s"] > 0.0, case
            assert case["etcd_cpu_s"] >= 0.0, case
            assert case["etcd_write_mb"] >= 0.0, case
        if case["case"] not in ("ranks", "inflight"):
            continue  # the sequential and group cases: timed and counted by their own keys
        assert case["seconds"] > 0
        assert case["etcd_writes"] >= 1
        assert case["visible_replies"] >= 1
        assert case.get("visible_transactions", 1) == 1
    assert out["ops_per_shard"] == shards.OPS_PER_SHARD
    assert out["revision_target"] == 1 + shards.REVISION_SLACK  # ceil(8 * 3 / 128) + 10
    assert set(out["one_shard_ms"]) == {"2"}


def test_herd_smoke() -> None:
    """A herd of 24 clients at once on two ceiling processes and on two hub replicas: every
    client opens, renews and watches; nothing expires."""
    from bench.scale.clients import Fleet
    from bench.scale.herd import HerdSpec, ceiling_herd, herd_round
    from bench.scale.world import World

    spec = HerdSpec(clients=24, workers=2, hold=1.0, connect_seconds=30.0, singles=2)
    with Fleet(2, prober=False) as fleet:
        ceiling = ceiling_herd(2, spec, fleet, lambda _: None)
        with World(replicas=2, metrics=True) as world:
            hub = herd_round("hub", world.hubs, world.token, spec, fleet, lambda _: None)
    for r in (ceiling, hub):
        assert "failed" not in r, r.get("failed")
        assert r["sessions"] == r["renewed_sessions"] == 24
        assert r["errors"] == {}
        assert r["expired"] == 0
        assert r["watches_counted"] == 24
        assert 0 < r["all_opened_s"] <= r["all_open_and_watching_s"]
        assert r["one_open_ms"] > 0


def test_reconnect_smoke() -> None:
    """SIGKILL of a replica under 6 SDK clients: every session is kept on its lease, with
    its holder record, and renewed within its TTL."""
    from bench.scale import reconnect

    out = reconnect.run(6, workers=1, ttl=3, observe=3.0, concurrency=4)
    assert "failed" not in out, out["failed"]
    assert out["connected"] == out["same_session"] == out["holders_intact"] == 6
    assert out["renewed_within_ttl"] == 6
    assert out["errors"] == 0
    assert out["latest_before_kill"] == 1
