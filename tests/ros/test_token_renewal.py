"""A fetch outlives its read token (issue 13, item 9), with a real hub over real etcd.

The hub issues read tokens for `TTL` seconds (`HubServer(read_token_ttl=...)`; 300 s in
production) and holders check the token on every GET. The trainer's holder sends each
chunk after a pause (`Fault(chunk_delay=...)`) so that the fetch takes well over two token
lifetimes; the rate floor is off (the holder is slow on purpose). Each GET asks for one
chunk (`BATCH_BYTES` is set to the chunk size), so the holder sees GETs all through the
fetch, as it does every 64 MiB of a multi-GiB fetch at 300 s.

With renewal (ros.client.read_token) the SDK's fetch succeeds and sent more than one token.
Without it — the same read with the first token as fixed bytes — every GET after the
token's expiry is DENIED and the fetch fails with PermissionDenied: what the SDK did before.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

import pytest

import ros
from chaos.holder_faults import Fault
from consistency import EtcdCluster, Keys
from ros.client.hooks import ClientHooks
from ros.client.read_token import RETRY_AFTER, RenewingToken
from ros.hub.server import HubServer
from ros.hub.tenants import TenantStore
from tensorhub.errors import InvalidArgument, PermissionDenied, Unavailable
from tests.ros.conftest import ADMIN
from tests.ros.helpers import digest, make_model
from transport import fetch_state
from transport.layout import Layout
from transport.planner import Source
from transport.reader import fetch
from transport.store import HeldVersion
from transport.topology import Topology

TTL = 3.0  # seconds a read token lives here
CHUNK = 64 * 1024
DELAY = 1.0  # the trainer's pause before each chunk
PARALLEL = 4  # the SDK's connections per fetch (transport.reader.DEFAULT_PARALLEL)


@pytest.fixture
def short_tokens(etcd_cluster: EtcdCluster, keys: Keys) -> Iterator[HubServer]:
    server = HubServer(
        etcd_cluster.endpoints, admin_token=ADMIN, keys=keys, read_token_ttl=TTL
    ).start()
    yield server
    server.stop(grace=0.2)


@pytest.fixture
def clients(short_tokens: HubServer) -> Iterator[Callable[..., ros.Hub]]:
    token = TenantStore(short_tokens.etcd, short_tokens.keys).create("team-a")
    opened: list[ros.Hub] = []

    def open_client(**kwargs: object) -> ros.Hub:
        client = ros.connect(short_tokens.address, tenant="team-a", token=token, **kwargs)  # type: ignore[arg-type]
        opened.append(client)
        return client

    yield open_client
    for client in opened:
        client.close()


def _slow_trainer(
    clients: Callable[..., ros.Hub], monkeypatch: pytest.MonkeyPatch
) -> tuple[ros.Hub, dict[str, object], float]:
    """A trainer whose holder pauses DELAY before each chunk, and the least time a fetch
    of its model with PARALLEL one-chunk GETs takes."""
    monkeypatch.setattr(fetch_state, "BATCH_BYTES", CHUNK)  # one chunk per GET
    trainer = clients(hooks=ClientHooks(send=Fault(chunk_delay=DELAY)))
    weights = make_model(5, big=24 * CHUNK // 4)  # 24 chunks of float32, and the small ones
    trainer.publish("policy", 1, weights, chunk_size=CHUNK)
    chunks = Layout.from_tensors(weights, chunk_size=CHUNK).num_chunks
    return trainer, dict(weights), math.ceil(chunks / PARALLEL) * DELAY


@pytest.mark.timeout(120)
def test_a_fetch_outlives_its_read_token(
    clients: Callable[..., ros.Hub], monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer, weights, least = _slow_trainer(clients, monkeypatch)
    assert least > 2 * TTL  # the fetch outlives at least two token lifetimes
    reader = clients()
    held = reader.fetch("policy", 1, timeout=60, rate_floor=0)
    assert digest(held.tensors) == digest(weights)  # type: ignore[arg-type]
    assert held.stats.failed_sources == {}  # no holder refused a token
    assert held.stats.duration >= least
    assert held.stats.read_tokens >= 2  # renewed mid-fetch
    assert held.stats.bytes_per_source == {trainer.holder_name: held.stats.total_bytes}


@pytest.mark.timeout(120)
def test_without_renewal_the_same_fetch_is_refused_part_way(
    clients: Callable[..., ros.Hub], monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer, weights, _ = _slow_trainer(clients, monkeypatch)
    reader = clients()
    resolved = reader.resolve("policy", 1)  # one token for the whole fetch
    layout = Layout.from_tensors(weights, chunk_size=CHUNK)  # type: ignore[arg-type]
    dest = HeldVersion.reader("team-a", "policy", 1, layout, layout.allocate())
    host, port = trainer._serving.server.address
    with pytest.raises(PermissionDenied, match="DENIED"):
        fetch(
            "team-a", "policy", 1, layout, dest, [Source(trainer.holder_name, host, port)],
            token=bytes(resolved.read_token), deadline=time.monotonic() + 60, me=Topology(),
            parallel=PARALLEL, rate_floor=0,
        )  # fmt: skip
    assert 0 < len(dest.missing()) < layout.num_chunks  # refused part-way, not at once


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_renewal_starts_within_the_margin_and_survives_a_failed_attempt() -> None:
    clock = _Clock()
    answers: list[tuple[bytes, int] | Exception] = [Unavailable("hub down"), (b"second", 1300)]
    calls: list[float] = []

    def renew() -> tuple[bytes, int]:
        calls.append(clock.now)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    tokens = RenewingToken(b"first", 1200, renew, margin=60.0, clock=clock)
    clock.now = 1139.0  # 61 s left: not yet
    assert tokens() == b"first"
    assert calls == []
    clock.now = 1141.0  # 59 s left: renew, which fails: the current token is still good
    assert tokens() == b"first"
    assert calls == [1141.0]
    clock.now += RETRY_AFTER / 2  # too soon to ask again
    assert tokens() == b"first"
    assert len(calls) == 1
    clock.now += RETRY_AFTER
    assert tokens() == b"second"
    assert tokens.expiry == 1300
    assert tokens.renewals == 1
    tokens.offer(b"older", 1250)  # a Resolve's token that lives less: ignored
    assert tokens() == b"second"
    tokens.offer(b"newer", 1400)
    assert tokens() == b"newer"


def test_a_short_token_is_renewed_in_its_second_half() -> None:
    clock = _Clock()
    tokens = RenewingToken(b"a", 1004, lambda: (b"b", 1008), clock=clock)
    clock.now = 1001.9  # 2.1 of 4 s left
    assert tokens() == b"a"
    clock.now = 1002.1
    assert tokens() == b"b"


def test_the_hub_refuses_a_token_ttl_holders_would_refuse(
    etcd_cluster: EtcdCluster, keys: Keys
) -> None:
    for ttl in (0.0, -1.0, 601.0):
        with pytest.raises(InvalidArgument, match="read token TTL"):
            HubServer(etcd_cluster.endpoints, admin_token=ADMIN, keys=keys, read_token_ttl=ttl)
