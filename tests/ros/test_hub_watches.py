"""What a hot model costs a hub replica: one etcd watch, no etcd stream and no thread.

A model is hot when clients watch it (the fan-out) and resolve it (the holder index). Both
read the same etcd watch (`ros.hub.model_feed`), on the replica's one multiplexed etcd
Watch stream. The watches and streams are counted by etcd itself (its /metrics), the
threads in the process that runs the hub (but for the bounded worker pools, which grow to
their configured size with calls, whatever the models).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from consistency import EtcdCluster
from ros.hub.server import HubServer
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from ros.proto.tensorhub.v1 import hub_pb2_grpc


def _etcd_gauge(cluster: EtcdCluster, name: str) -> float:
    """One unlabelled gauge of the (single) etcd member's /metrics."""
    url = f"http://{cluster.endpoints[0]}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"etcd's /metrics has no {name}")


POOLS = ("hub-worker", "hub-commit", "retention")  # thread name prefixes of the bounded pools


def _threads() -> int:
    return sum(not t.name.startswith(POOLS) for t in threading.enumerate())


def _settle(read: Callable[[], float]) -> float:
    """`read()` once it has given the same value for a while (watch creates and cancels
    reach etcd asynchronously)."""
    last, since = read(), time.monotonic()
    deadline = since + 10
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = read()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 0.5:
            return now
    return last


@pytest.fixture
def stub(hub_server: HubServer) -> Iterator[hub_pb2_grpc.TensorHubStub]:
    channel = grpc.insecure_channel(hub_server.address)
    yield hub_pb2_grpc.TensorHubStub(channel)  # type: ignore[no-untyped-call]
    channel.close()


@pytest.mark.timeout(120)
def test_a_hot_model_costs_one_etcd_watch_and_no_thread(
    etcd_cluster: EtcdCluster,
    hub_server: HubServer,
    make_tenant: Callable[[str], str],
    stub: hub_pb2_grpc.TensorHubStub,
) -> None:
    metadata = (("authorization", f"Bearer {make_tenant('hot')}"),)
    hub = hub_server.servicer.hub
    watches: list[Any] = []  # the open Watch calls

    session = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=30), metadata=metadata)

    def publish(model: str) -> int:
        request = pb.PublishRequest(
            model=model,
            version=1,
            manifest=pb.Manifest(
                tensors=[pb.TensorEntry(name="w", dtype="float32", shape=[4], nbytes=16)],
                total_bytes=16,
                chunk_size=4096,
                chunk_xxh3=[1],
            ),
            holder=pb.Holder(
                name="trainer",
                endpoints={"tcp": "127.0.0.1:9"},
                state=pb.COMPLETE,
                session_id=session.session_id,
            ),
        )
        return int(stub.Publish(request, metadata=metadata, timeout=10).revision)

    def heat(model: str) -> None:
        """Watch the model (a stream, held open) and resolve it (the index)."""
        revision = publish(model)
        watch = stub.Watch(
            pb.WatchRequest(model=model, start_revision=revision + 1), metadata=metadata
        )
        watches.append(watch)
        deadline = time.monotonic() + 10
        while ("hot", model) not in hub.fanout._shared:
            assert time.monotonic() < deadline, "the Watch stream did not reach the hub"
            time.sleep(0.05)
        stub.Resolve(pb.ResolveRequest(model=model, version=1), metadata=metadata, timeout=10)
        assert len(hub.holder_index) >= 1

    def counts() -> tuple[float, float, int]:
        watchers = _settle(lambda: _etcd_gauge(etcd_cluster, "etcd_debugging_mvcc_watcher_total"))
        streams = _etcd_gauge(etcd_cluster, "etcd_debugging_mvcc_watch_stream_total")
        return watchers, streams, _threads()

    try:
        heat("first")  # the replica's watch stream opens with its first hot model
        watchers, streams, threads = counts()
        for model in ("second", "third"):
            heat(model)
        more_watchers, more_streams, more_threads = counts()
        assert more_watchers - watchers == 2  # one etcd watch per hot model...
        assert hub.feeds.feeds() == 3  # ... shared by the fan-out and the index
        assert more_streams == streams  # on the replica's one stream
        assert more_threads == threads  # and no thread
    finally:
        for watch in watches:
            watch.cancel()
