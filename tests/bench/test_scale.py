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
