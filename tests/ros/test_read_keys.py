"""Read tokens cannot live forever (issue 12, item 13), against a real hub, etcd and holders.

- A token minted with a far expiry (10**11 was accepted) is refused by a holder.
- Read keys rotate: after a rotation beyond the overlap, a former client's key no longer
  mints tokens a holder accepts, while a live session's holder keeps serving.
- The schedule itself: the key the hub signs with is always one a holder that renewed
  within half a period accepts, and stays accepted for half a period (explicit clocks).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

import ros
from consistency import EtcdCluster, Keys
from ros.hub.server import HubServer
from ros.hub.tenants import TenantStore
from ros.tokens import (
    MAX_READ_TOKEN_LIFETIME,
    ReadKey,
    ReadKeySchedule,
    ReadTokenVerifier,
    issue_read_token,
)
from tests.ros.conftest import ADMIN
from tests.ros.helpers import digest, make_model, read_policy_1
from tests.waiting import wait_until

PERIOD = 4.0  # seconds: rotation within a test (sessions renew every second: TTL 3)


def _reads(holder: ros.Hub, key: ReadKey) -> bool:
    """Whether `holder` serves policy@1 to a token minted with `key`."""
    minted, _ = issue_read_token(key, "team-a", "policy", 1)
    try:
        read_policy_1(holder, minted)
    except ros.PermissionDenied:
        return False
    return True


def test_a_token_with_a_far_expiry_is_refused_by_a_holder(
    connect: Callable[..., ros.Hub],
) -> None:
    holder = connect()
    holder.publish("policy", 1, make_model(1))
    key = holder.session.read_key
    for ttl in (10**11 - time.time(), MAX_READ_TOKEN_LIFETIME + 60):
        forever, _ = issue_read_token(key, "team-a", "policy", 1, ttl=ttl)
        with pytest.raises(ros.PermissionDenied):
            read_policy_1(holder, forever)
    ordinary, _ = issue_read_token(key, "team-a", "policy", 1)  # what the hub issues
    read_policy_1(holder, ordinary)


@pytest.fixture
def rotating_hub(etcd_cluster: EtcdCluster, keys: Keys) -> Iterator[HubServer]:
    server = HubServer(
        etcd_cluster.endpoints, admin_token=ADMIN, keys=keys, read_key_period=PERIOD
    ).start()
    yield server
    server.stop(grace=0.2)


@pytest.mark.timeout(120)
def test_after_rotation_a_former_clients_key_mints_nothing_a_live_holder_accepts(
    rotating_hub: HubServer,
) -> None:
    token = TenantStore(rotating_hub.etcd, rotating_hub.keys).create("team-a")
    address = rotating_hub.address

    def connect() -> ros.Hub:
        return ros.connect(address, tenant="team-a", token=token, session_ttl=3)

    weights = make_model(1)
    with connect() as holder:
        holder.publish("policy", 1, weights)
        former = connect()
        stolen = list(former.session.read_keys)  # all a former client ever learned
        former.close()
        # the control: before rotation its keys still work (one at least: the holder's last
        # renewal and the former client's open may lie either side of a period boundary)
        assert any(_reads(holder, key) for key in stolen)
        ids = {k.id for k in stolen}
        wait_until(
            "the live holder's keys rotated past every key the former client had",
            lambda: not ids & {k.id for k in holder.session.read_keys},
            timeout=4 * PERIOD,
        )
        assert not any(_reads(holder, key) for key in stolen)
        # the live session's holder kept serving across the rotation: a new reader's fetch
        # (with a token the hub signed after it) reads from it
        with connect() as reader:
            got = reader.fetch("policy", 1, timeout=30)
            assert digest(got.tensors) == digest(weights)


def test_the_signing_key_is_known_to_every_holder_that_renewed_within_half_a_period() -> None:
    period = 100.0
    schedule = ReadKeySchedule(b"s" * 32, period)

    def accepted_at(learned: float) -> ReadTokenVerifier:
        return ReadTokenVerifier(schedule.current("t", "e", now=learned), "t")

    for step in range(0, 400, 7):  # issue times across four periods, both sides of each edge
        issued = 1_000_000.0 + step
        signing = schedule.signing("t", "e", now=issued)
        for lag in (0.0, period / 4, period / 2 - 1):  # the holder learned its keys lag ago
            assert signing.id in accepted_at(issued - lag).key_ids, (step, lag)
        for later in (0.0, period / 4, period / 2 - 1):  # still accepted half a period on
            assert signing.id in accepted_at(issued + later).key_ids, (step, later)
    # an epoch (a tenant created again) and a period both change every key
    one = schedule.current("t", "e", now=0.0)[0]
    assert one != schedule.current("t", "other", now=0.0)[0]
    assert one != schedule.current("t", "e", now=period)[0]
    assert isinstance(one, ReadKey)
