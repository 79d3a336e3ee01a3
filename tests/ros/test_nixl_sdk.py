"""NIXL through the SDK (`ros.connect(transports=["nixl"])`), against a real hub, between real
processes, over UCX's TCP transport and over same-host cma: a version published and fetched
over NIXL, each reader becoming a NIXL holder for the next, a holder SIGKILLed or SIGSTOPped
mid-read (the fetch completes from another holder, never hangs), and another tenant's read
token refused on a holder's NIXL port. The backend's own cases (corrupt bytes, a release
during a read, a wrong token, the deadline and rate floor) are tests/transport/test_nixl.py.

Holders run in processes of their own (tests/ros/nixl_client_proc.py), the reader in this
one. Skipped where NIXL is not installed (`pip install 'tensorhub[nixl]'`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import ros
from ros.client.manifest import layout_of
from ros.client.orchestrator import Progress
from ros.hub.server import HubServer
from tensorhub.endpoints import parse_endpoint
from tests.nixl_support import UCX, use_ucx
from tests.ros.nixl_client_proc import MODEL, nixl_weights
from transport.frames import recv_message, send_message
from transport.nixl.loader import unavailable_reason
from transport.nixl.protocol import MAX_OFFER_BYTES, NixlRequest, decode_offer, encode_request
from transport.wire import ErrorCode, Refusal

_WHY = unavailable_reason()
pytestmark = [
    pytest.mark.skipif(_WHY is not None, reason=f"NIXL unavailable: {_WHY}"),
    pytest.mark.timeout(120),
]
ROOT = Path(__file__).resolve().parents[2]


class Client:
    """A client process holding `MODEL@1` and serving it over TCP and NIXL."""

    def __init__(self, proc: subprocess.Popen[str], endpoints: dict[str, str]) -> None:
        self.proc, self.endpoints = proc, endpoints

    def command(self, line: str) -> str:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()


@pytest.fixture(params=sorted(UCX))
def ucx(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    return use_ucx(request.param, monkeypatch)


@pytest.fixture
def team_a(make_tenant: Callable[[str], str]) -> str:
    """team-a's token."""
    return make_tenant("team-a")


@pytest.fixture
def readers(hub_server: HubServer, team_a: str) -> Iterator[Callable[..., ros.Hub]]:
    """team-a's clients in this process (closed at teardown)."""
    opened: list[ros.Hub] = []

    def open_client(**kwargs: object) -> ros.Hub:
        client = ros.connect(hub_server.address, tenant="team-a", token=team_a, **kwargs)  # type: ignore[arg-type]
        opened.append(client)
        return client

    yield open_client
    for client in opened:
        client.close()


@pytest.fixture
def clients(
    hub_server: HubServer, team_a: str, ucx: dict[str, str]
) -> Iterator[Callable[..., Client]]:
    """Start team-a's client processes; each is killed (even when stopped) at teardown."""
    token = team_a
    procs: list[subprocess.Popen[str]] = []

    def start(role: str, name: str, mib: int = 16) -> Client:
        args = [
            sys.executable, "-m", "tests.ros.nixl_client_proc", "--hub", hub_server.address,
            "--tenant", "team-a", "--token", token, "--role", role, "--name", name,
            "--mib", str(mib),
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
        env |= {**ucx, "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "WARN"}
        proc = subprocess.Popen(
            args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("READY "):
                return Client(proc, json.loads(line.split(" ", 1)[1]))
        raise AssertionError(f"{name} exited with {proc.wait()} before serving")

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait()


def test_a_version_published_over_nixl_is_fetched_over_nixl(
    clients: Callable[..., Client], readers: Callable[..., ros.Hub]
) -> None:
    publisher = clients("publish", "trainer")
    assert "nixl" in publisher.endpoints
    assert "tcp" in publisher.endpoints
    hub = readers(transports=["nixl"], name="rollout")
    held = hub.fetch(MODEL, 1, timeout=60)
    assert held.stats.transports == {"trainer": "nixl"}
    for name, tensor in nixl_weights(16).items():
        assert torch.equal(held.tensors[name], tensor), name
    # the reader is a holder now, over NIXL too
    (mine,) = [h for h in hub.holders(MODEL, 1) if h.holder == "rollout"]
    assert set(mine.endpoints) == {"tcp", "nixl"}
    held.release(force=True)


def test_each_reader_becomes_a_nixl_holder_for_the_next(
    clients: Callable[..., Client], readers: Callable[..., ros.Hub]
) -> None:
    publisher = clients("publish", "trainer")
    clients("fetch", "first")  # read from the trainer over NIXL, and holds it
    assert publisher.command("release") == "RELEASED"
    hub = readers(transports=["nixl"], name="second")
    held = hub.fetch(MODEL, 1, timeout=60)
    assert held.stats.transports == {"first": "nixl"}
    assert torch.equal(held.tensors["layer3.weight"], nixl_weights(16)["layer3.weight"])


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_holder_lost_mid_read_is_failed_over(
    clients: Callable[..., Client], readers: Callable[..., ros.Hub], sig: signal.Signals
) -> None:
    """The reader reads two holders at once; one is killed (NIXL raises within a fraction of
    a second) or frozen (the READ is cut at the rate floor or the deadline; over cma a READ
    in flight may still complete) at the first chunk: the fetch completes, byte-exact,
    from the other, within its deadline."""
    publisher = clients("publish", "trainer", mib=64)
    clients("fetch", "first", mib=64)
    hub = readers(transports=["nixl"], name="second")
    hit: list[int] = []

    def lose_the_trainer(progress: Progress) -> None:
        if not hit:
            hit.append(progress.chunks)
            publisher.proc.send_signal(sig)

    held = hub.fetch(MODEL, 1, timeout=60, progress=lose_the_trainer)
    assert hit
    for name, tensor in nixl_weights(64).items():
        assert torch.equal(held.tensors[name], tensor), name
    assert held.stats.transports.get("first") == "nixl"
    assert held.stats.bytes_per_source.get("first", 0) > 0


def test_another_tenants_read_token_is_refused_on_the_nixl_port(
    clients: Callable[..., Client],
    readers: Callable[..., ros.Hub],
    connect: Callable[..., ros.Hub],
) -> None:
    """team-b's read token (valid, for its own model) asking team-a's holder for team-a's
    version over NIXL, named as team-a or as team-b: DENIED, and no agent metadata sent."""
    publisher = clients("publish", "trainer")
    owner = readers()
    layout = layout_of(owner.resolve(MODEL, 1).manifest)
    other = connect("team-b")
    other.publish("mine", 1, {"w": torch.ones(8)})
    token = other.resolve("mine", 1).read_token
    host, port = parse_endpoint(publisher.endpoints["nixl"])
    for tenant in ("team-a", "team-b"):
        with socket.create_connection((host, port), timeout=10) as sock:
            request = NixlRequest(tenant, MODEL, 1, layout.digest, token)
            send_message(sock, encode_request(request))
            answer = decode_offer(recv_message(sock, MAX_OFFER_BYTES))
        assert isinstance(answer, Refusal), tenant
        assert answer.code is ErrorCode.DENIED, (tenant, answer)
