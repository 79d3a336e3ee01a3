"""A fetch keeps its deadline when the hub stalls (issue 12, item 7).

The attack: the hub answers the first Resolve of a `fetch(timeout=3)`, then goes silent.
The old client gave every later call (RegisterHolder or UpdateHolder, then the cleanup
ReleaseHolder) its own 10 s default, so the fetch returned after about 20 s, and `close()`
waited 5 s more for CloseSession. Here a real TCP proxy (`chaos.proxy`) sits between the
reader and the hub and is frozen (blackholed: connections stay open, no byte moves) right
after a chosen call returns; the trainer reaches the hub directly and serves the bytes.

Bounds: the fetch raises `DeadlineExceeded` within its timeout + 2 s (slack for a loaded
machine), and `close()` within its documented bound, `CLOSE_SESSION_TIMEOUT` plus the 2 s
the keepalive thread's join may take, + 1 s (it measures about 1 s; the old code 5 s).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ros
from chaos.proxy import Proxy
from ros.client.channel import parse_address
from ros.client.hub import CLOSE_SESSION_TIMEOUT
from ros.hub.server import HubServer
from tests.ros.helpers import make_model

TIMEOUT = 3.0
MARGIN = 2.0
CLOSE_BOUND = CLOSE_SESSION_TIMEOUT + 2.0  # close()'s documented bound, with a stalled hub


@pytest.fixture
def proxy(hub_server: HubServer) -> Iterator[Proxy]:
    """A freezable TCP proxy in front of the hub, on loopback."""
    relay = Proxy(("127.0.0.1", 0), parse_address(hub_server.address)).start()
    yield relay
    relay.set("pass")
    relay.stop()


def _freeze_after(client: ros.Hub, proxy: Proxy, method: str) -> None:
    """Blackhole the client's link to the hub as soon as its first `method` call returns
    (the stub's method is wrapped: every caller in the client shares that stub)."""
    stub = client._stub
    rpc: Callable[..., Any] = getattr(stub, method)

    def call(request: Any, **kwargs: Any) -> Any:
        answer = rpc(request, **kwargs)
        proxy.set("blackhole")
        return answer

    setattr(stub, method, call)


@pytest.fixture
def clients(
    hub_server: HubServer, proxy: Proxy, make_tenant: Callable[[str], str]
) -> Iterator[tuple[ros.Hub, ros.Hub]]:
    """A trainer on the hub itself, and a reader of the same tenant behind the proxy."""
    token = make_tenant("team-a")
    trainer = ros.connect(hub_server.address, tenant="team-a", token=token)
    reader = ros.connect(proxy.address, tenant="team-a", token=token)
    yield trainer, reader
    proxy.set("pass")
    reader.close()
    trainer.close()


@pytest.mark.parametrize("stall_after", ["Resolve", "RegisterHolder"])
def test_fetch_and_close_keep_their_deadlines_when_the_hub_stalls(
    clients: tuple[ros.Hub, ros.Hub],
    proxy: Proxy,
    caplog: pytest.LogCaptureFixture,
    stall_after: str,
) -> None:
    trainer, reader = clients
    trainer.publish("policy", 1, make_model(1))
    _freeze_after(reader, proxy, stall_after)
    caplog.set_level(logging.WARNING, logger="ros.client")
    start = time.monotonic()
    with pytest.raises(ros.DeadlineExceeded):
        reader.fetch("policy", 1, timeout=TIMEOUT)
    took = time.monotonic() - start
    assert took < TIMEOUT + MARGIN, f"fetch(timeout={TIMEOUT}) took {took:.1f}s"
    assert "left to the session's lease" in caplog.text
    start = time.monotonic()
    reader.close()  # the hub is still stalled
    took = time.monotonic() - start
    assert took < CLOSE_BOUND + 1.0, f"close() took {took:.1f}s"


def test_fetch_slices_keeps_its_deadline_when_the_hub_stalls(
    clients: tuple[ros.Hub, ros.Hub], proxy: Proxy
) -> None:
    trainer, reader = clients
    model = make_model(2)
    name = next(iter(model))
    trainer.publish("policy", 1, model, shard=(0, 1))
    _freeze_after(reader, proxy, "Resolve")  # the Pin (or the shard's Resolve) stalls
    want = ros.Slice(torch.zeros_like(model[name]), [0] * model[name].dim(), model[name].shape)
    start = time.monotonic()
    with pytest.raises(ros.DeadlineExceeded):
        reader.fetch_slices("policy", 1, slices={name: want}, timeout=TIMEOUT)
    took = time.monotonic() - start
    assert took < TIMEOUT + MARGIN, f"fetch_slices(timeout={TIMEOUT}) took {took:.1f}s"
