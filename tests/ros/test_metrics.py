"""Prometheus metrics move with the work: bytes fetched per source and served, sessions, RPCs."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY

import ros
from tests.ros.helpers import make_model


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_metrics_follow_a_publish_and_a_fetch(connect: Callable[..., ros.Hub]) -> None:
    trainer = connect()
    served_before = value("tensorhub_sdk_bytes_served_total")
    fetched_before = value("tensorhub_sdk_bytes_fetched_total", source=trainer.holder_name)
    publishes_before = value("tensorhub_hub_requests_total", method="Publish", code="OK")
    weights = make_model(2)
    trainer.publish("policy", 1, weights)
    reader = connect()
    held = reader.fetch("policy", 1)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    assert held.stats.total_bytes == nbytes
    fetched = value("tensorhub_sdk_bytes_fetched_total", source=trainer.holder_name)
    assert fetched - fetched_before == nbytes
    assert value("tensorhub_sdk_bytes_served_total") - served_before == nbytes
    assert (
        value("tensorhub_hub_requests_total", method="Publish", code="OK") == publishes_before + 1
    )
    assert value("tensorhub_sdk_fetch_seconds_count") >= 1
    assert value("tensorhub_hub_sessions_active") >= 2  # both keepalive streams are attached here
