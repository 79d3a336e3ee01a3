"""A read-token verifier that raises refuses the read and is logged, on the data port and
on the control channels alike (`transport.verifier.lookup`)."""

from __future__ import annotations

import logging

import pytest

from transport.store import HolderStore
from transport.verifier import Refused, lookup, token_allowed
from transport.wire import ErrorCode


def _broken(tenant: str, model: str, version: int, token: bytes) -> bool:
    raise KeyError("no such key in the verifier's table")


def test_a_raising_verifier_refuses_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="transport.verifier"):
        assert not token_allowed(_broken, "t", "m", 3, b"tok")
    assert "verifier raised for t/m@3" in caplog.text
    assert token_allowed(lambda *_: True, "t", "m", 3, b"tok")


def test_the_control_channels_refuse_a_raising_verifier_the_same_way(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="transport.verifier"):
        refused = lookup(HolderStore(), _broken, ("t", "m", 3), b"tok", 0)
    assert refused == Refused(ErrorCode.DENIED, "read token refused", token_ok=False)
    assert "no such key" in caplog.text
