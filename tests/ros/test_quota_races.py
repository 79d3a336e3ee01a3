"""Quotas hold when creates race: concurrent first publishes of new models, and concurrent
session opens, never take a tenant over its quota (`consistency.quota`)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

import ros
from ros.hub.server import HubServer
from ros.hub.tenants import Quotas, TenantStore
from tests.ros.helpers import make_model

RACERS = 6


def race(action: Callable[[int], None]) -> tuple[int, list[BaseException]]:
    """Run `action(i)` in RACERS threads released together; (successes, errors)."""
    barrier = threading.Barrier(RACERS)
    ok: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        barrier.wait(timeout=30)
        try:
            action(i)
        except BaseException as exc:  # collected and checked below
            with lock:
                errors.append(exc)
        else:
            with lock:
                ok.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(RACERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return len(ok), errors


def test_concurrent_new_models_never_exceed_the_model_quota(hub_server: HubServer) -> None:
    token = TenantStore(hub_server.etcd, hub_server.keys).create(
        "models-race", Quotas(max_models=2)
    )
    clients = [
        ros.connect(hub_server.address, tenant="models-race", token=token) for _ in range(RACERS)
    ]
    try:
        clients[0].publish("first", 1, make_model(0))  # one of the two slots is taken
        weights = [{"w": torch.full((4,), float(i))} for i in range(RACERS)]  # no client work
        ok, errors = race(lambda i: clients[i].publish(f"new-{i}", 1, weights[i]) and None)
        assert ok == 1, f"{ok} new models admitted with one slot left: {errors}"
        assert all(isinstance(e, ros.QuotaExceeded) for e in errors), errors
        assert len(clients[0].list_models()) == 2
    finally:
        for c in clients:
            c.close()


def test_concurrent_session_opens_never_exceed_the_session_quota(hub_server: HubServer) -> None:
    token = TenantStore(hub_server.etcd, hub_server.keys).create(
        "sessions-race", Quotas(max_sessions=3)
    )
    opened: list[ros.Hub] = []
    lock = threading.Lock()

    def open_one(_: int) -> None:
        client = ros.connect(hub_server.address, tenant="sessions-race", token=token)
        with lock:
            opened.append(client)

    try:
        ok, errors = race(open_one)
        assert ok == 3, f"{ok} sessions opened with a quota of 3: {errors}"
        assert all(isinstance(e, ros.QuotaExceeded) for e in errors), errors
    finally:
        for c in opened:
            c.close()
