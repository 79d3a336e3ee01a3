"""Prometheus metrics of the hub and the SDK (one registry per process, defined once here)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

HUB_REQUESTS = Counter(
    "tensorhub_hub_requests_total", "Hub RPCs by method and status code", ["method", "code"]
)
HUB_LATENCY = Histogram("tensorhub_hub_request_seconds", "Hub RPC latency", ["method"])
HUB_SESSIONS = Gauge(
    "tensorhub_hub_sessions_active",
    "Sessions whose keepalive stream is attached to this replica (sum over replicas: all)",
)
HUB_SESSIONS_OPENED = Counter("tensorhub_hub_sessions_opened_total", "Sessions opened here")
HUB_WATCHES = Gauge("tensorhub_hub_watches_active", "Watch streams being served by this replica")
HUB_STREAMS_ACTIVE = Gauge(
    "tensorhub_hub_streams_active",
    "Streams open on this replica by kind (keepalive, watch, private_watch: a replay)",
    ["kind"],
)
HUB_STREAM_LIMIT = Gauge(
    "tensorhub_hub_stream_limit",
    "Stream limits of this replica by scope (replica, tenant, private_watch)",
    ["scope"],
)
HUB_STREAMS_REFUSED = Counter(
    "tensorhub_hub_streams_refused_total",
    "Streams refused with Overloaded, by the limit that was reached",
    ["scope"],
)
HUB_INTERNAL_ERRORS = Counter(
    "tensorhub_hub_internal_errors_total", "Handler failures that were not a TensorHubError"
)

SDK_BYTES_FETCHED = Counter(
    "tensorhub_sdk_bytes_fetched_total", "Bytes received by fetches, by source holder", ["source"]
)
SDK_BYTES_SERVED = Counter(
    "tensorhub_sdk_bytes_served_total", "Bytes this client served to readers"
)
SDK_FETCH_SECONDS = Histogram("tensorhub_sdk_fetch_seconds", "Time of a whole fetch")
SDK_PUBLISH_SECONDS = Histogram("tensorhub_sdk_publish_seconds", "Time of a publish call")
SDK_TRAINER_STALL = Histogram(
    "tensorhub_sdk_trainer_stall_seconds", "Time a trainer spent in wait_replicated"
)
