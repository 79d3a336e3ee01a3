"""Prometheus metrics of the hub and the SDK (one registry per process, defined once here)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

if TYPE_CHECKING:
    from consistency.compactor import CompactorStatus

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

# etcd history (consistency.compactor): `CompactorMetrics` below sets these from each replica's
# compactor; sizes and the compacted revision come from the replica that holds the role.
ETCD_DB_SIZE = Gauge(
    "tensorhub_etcd_db_size_bytes", "Largest etcd member database file (what the quota counts)"
)
ETCD_DB_SIZE_IN_USE = Gauge(
    "tensorhub_etcd_db_size_in_use_bytes", "Live part of that member's database (etcd 3.4+)"
)
ETCD_STORAGE_FULL = Gauge(
    "tensorhub_etcd_storage_full", "1 while etcd's NOSPACE alarm is raised (writes refused)"
)
ETCD_COMPACTED_REVISION = Gauge(
    "tensorhub_etcd_compacted_revision", "Revision the compactor last compacted etcd to"
)
ETCD_COMPACTOR_LEADER = Gauge(
    "tensorhub_etcd_compactor_leader", "1 on the replica that holds the compactor role"
)
ETCD_COMPACTIONS = Counter("tensorhub_etcd_compactions_total", "Compactions this replica ran")
ETCD_DEFRAGS = Counter("tensorhub_etcd_defrags_total", "Member defragments this replica ran")

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
HUB_CALLS_REFUSED = Counter(
    "tensorhub_hub_calls_refused_total",
    "Calls refused at their start by the call guard: no_token, bad_token, first_message "
    "(no request message within --first-message-timeout), or pending (too many calls "
    "await their first message)",
    ["reason"],
)
HUB_TENANT_RECORD_READS = Counter(
    "tensorhub_hub_tenant_record_reads_total",
    "etcd reads of tenant records to authenticate a token (a fresh record, or a name recently "
    "found missing, is answered from memory)",
)
HUB_UNKNOWN_TOKENS_REFUSED = Counter(
    "tensorhub_hub_unknown_tokens_refused_total",
    "Calls refused with Overloaded because the replica was already reading etcd for as many "
    "tokens of never-seen tenant names as it allows at once (a flood of made-up tokens)",
)
HUB_STREAMS_REFUSED = Counter(
    "tensorhub_hub_streams_refused_total",
    "Streams refused with Overloaded, by the limit that was reached",
    ["scope"],
)
HUB_INTERNAL_ERRORS = Counter(
    "tensorhub_hub_internal_errors_total", "Handler failures that were not a TensorHubError"
)
HUB_INDEXED_MODELS = Gauge(
    "tensorhub_hub_indexed_models", "Models in this replica's holder index (Resolve's view)"
)
HUB_RESOLVE_READS = Counter(
    "tensorhub_hub_resolve_etcd_reads_total",
    "Candidate lookups answered by a direct etcd read, not the holder index, by why",
    ["reason"],
)
HUB_BATCH_SIZE = Histogram(
    "tensorhub_hub_group_commit_batch",
    "Writes one group-commit transaction carried (ros.hub.group_commit), by kind",
    ["kind"],
    buckets=(1, 2, 4, 8, 16, 32, 61, 127),
)
HUB_PUBLISH_LIMIT = Gauge(
    "tensorhub_hub_publish_limit",
    "Publish limits checked before any write (manifest_bytes, shards; consistency.manifests)",
    ["limit"],
)
HUB_PUBLISHES_REFUSED = Counter(
    "tensorhub_hub_publishes_refused_total",
    "Publishes refused at a limit before any write, by the limit",
    ["limit"],
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
SDK_HOST_SPILLS = Counter(
    "tensorhub_sdk_host_spills_total",
    "Releases that copied a version to host memory: this client was the last complete holder "
    "of a retained version (rare in a healthy cluster)",
)
SDK_HOST_SPILL_BYTES = Gauge(
    "tensorhub_sdk_host_spill_bytes", "Bytes of versions this client serves from host spills now"
)


class CompactorMetrics:
    """Exports a compactor's snapshots: pass an instance as `Compactor(on_tick=...)`.

    The counters follow the compactor's own counts (one instance per compactor).
    """

    def __init__(self) -> None:
        self._compactions = 0
        self._defrags = 0

    def __call__(self, status: CompactorStatus) -> None:
        ETCD_STORAGE_FULL.set(int(status.storage_full))
        ETCD_COMPACTOR_LEADER.set(int(status.leader))
        if status.leader:
            ETCD_DB_SIZE.set(status.db_size)
            if status.db_size_in_use is not None:
                ETCD_DB_SIZE_IN_USE.set(status.db_size_in_use)
            ETCD_COMPACTED_REVISION.set(status.compacted_revision)
        ETCD_COMPACTIONS.inc(max(status.compactions - self._compactions, 0))
        ETCD_DEFRAGS.inc(max(status.defrags - self._defrags, 0))
        self._compactions, self._defrags = status.compactions, status.defrags
