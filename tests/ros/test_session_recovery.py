"""A client whose session is lost stops serving and re-registers what it holds under a new
session (docs/design.md, "Sessions and leases"), one version at a time: a version that
vanished meanwhile does not
keep the others unregistered."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

import ros
from ros.hub.server import HubServer
from tests.ros.helpers import make_model


def test_recovery_re_registers_every_version_still_published(
    connect: Callable[..., ros.Hub], hub_server: HubServer
) -> None:
    trainer = connect()
    first = trainer.publish("policy", 1, make_model(1))
    trainer.publish("other", 1, make_model(2))
    reader = connect(session_ttl=2)
    old = reader.fetch("policy", 1, timeout=30)  # registered first, so re-registered first
    kept = reader.fetch("other", 1, timeout=30)
    first.release()
    for v in (2, 3):  # retention (2 versions) deletes policy@1 under the reader's feet
        trainer.publish("policy", v, make_model(v)).release(force=True)
    lost = reader.session.id
    hub_server.etcd.lease_revoke(lost)
    deadline = time.monotonic() + 15
    while reader.holder_name not in [h.holder for h in reader.holders("other", 1)]:
        assert time.monotonic() < deadline, "other@1 was never re-registered"
        time.sleep(0.1)
    assert reader.session.id != lost
    (record,) = [h for h in reader.holders("other", 1) if h.holder == reader.holder_name]
    assert record.complete
    assert record.session == reader.session.id
    assert old.version == 1
    assert kept.version == 1


def test_a_lease_lost_answer_starts_recovery_without_waiting_for_the_next_renewal(
    connect: Callable[..., ros.Hub], hub_server: HubServer
) -> None:
    trainer = connect()
    trainer.publish("policy", 1, make_model(1))
    reader = connect(session_ttl=60)  # renewals every 20 s: far later than this test
    lost = reader.session.id
    deadline = time.monotonic() + 5
    while reader.session.renewals < 1:  # the first renewal, sent at once, is done with
        assert time.monotonic() < deadline, "the first renewal did not come back within 5 s"
        time.sleep(0.01)
    hub_server.etcd.lease_revoke(lost)
    with pytest.raises(ros.SessionExpired):  # a LeaseLost about the session itself
        reader.fetch("policy", 1, timeout=10)  # the hub says the session is gone
    deadline = time.monotonic() + 5
    while reader.session.id == lost:
        assert time.monotonic() < deadline, "no recovery within 5 s of the LeaseLost answer"
        time.sleep(0.05)
    held = reader.fetch("policy", 1, timeout=30)  # the next call works under the new session
    assert held.version == 1
