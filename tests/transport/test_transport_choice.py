"""Which transports a client uses (`transport.registry.enabled_transports`) and which one a
reader picks per holder (`transport.selection.choose`) once NIXL is among them: NIXL is
used only when named, preferred when both sides have it, and passed over, with the reason,
for a PARTIAL holder, a TLS reader or a destination in device memory. No NIXL is needed:
this is the choice, made before anything connects."""

from __future__ import annotations

import os

import pytest

from tensorhub.endpoints import validate_endpoints
from tensorhub.errors import InvalidArgument, NoUsableTransport
from transport.kinds import TransportKind
from transport.nixl.loader import unavailable_reason as nixl_unavailable
from transport.rdma import rdma_available
from transport.registry import ENV, available_transports, enabled_transports
from transport.selection import choose

HOLDER = {"tcp": "10.0.0.1:9000", "nixl": "10.0.0.1:9001"}
BOTH = (TransportKind.NIXL, TransportKind.TCP)


def test_nixl_is_read_when_both_sides_have_it() -> None:
    route = choose(HOLDER, complete=True, local=BOTH)
    assert (route.kind, route.host, route.port, route.fallback) == (
        TransportKind.NIXL, "10.0.0.1", 9001, ""
    )  # fmt: skip


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"complete": True, "local": (TransportKind.TCP,)}, "nixl: not enabled by this client"),
        ({"complete": False, "local": BOTH}, "nixl: the holder is PARTIAL"),
        ({"complete": True, "local": BOTH, "tls": True}, "NIXL reads are not encrypted"),
        ({"complete": True, "local": BOTH, "device_memory": True}, "destination is device memory"),
    ],
    ids=["not-enabled", "partial", "tls", "device-memory"],
)
def test_nixl_is_passed_over_for_tcp_with_the_reason(options: dict[str, object], why: str) -> None:
    route = choose(HOLDER, **options)  # type: ignore[arg-type]
    assert route.kind is TransportKind.TCP
    assert route.port == 9000
    assert why in route.fallback


def test_a_holder_advertising_only_nixl_to_a_reader_without_it_is_no_usable_transport() -> None:
    with pytest.raises(NoUsableTransport, match="nixl: not enabled by this client"):
        choose({"nixl": "10.0.0.1:9001"}, complete=True, local=(TransportKind.TCP,))


def test_the_hub_accepts_a_nixl_endpoint() -> None:
    assert validate_endpoints(HOLDER) == HOLDER


def test_nixl_is_used_only_when_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert enabled_transports() == tuple(available_transports())
    assert TransportKind.NIXL not in enabled_transports()
    assert enabled_transports([]) == (TransportKind.TCP,)  # TCP is always in
    with pytest.raises(InvalidArgument, match="unknown transport 'infiniband'"):
        enabled_transports(["infiniband"])
    with pytest.raises(InvalidArgument, match="unknown transport"):
        enabled_transports(env={ENV: "tcp,carrier-pigeon"})


@pytest.mark.skipif(rdma_available(), reason="this machine has a usable RDMA device")
def test_a_named_transport_this_machine_lacks_is_refused_with_the_reason() -> None:
    with pytest.raises(NoUsableTransport, match="'rdma' was asked for but no RDMA here"):
        enabled_transports(["rdma"])


@pytest.mark.skipif(nixl_unavailable() is not None, reason=f"NIXL: {nixl_unavailable()}")
def test_nixl_named_in_the_call_or_the_environment() -> None:
    assert enabled_transports(["nixl"]) == BOTH
    assert enabled_transports(env={ENV: " nixl , tcp "}) == BOTH
    assert enabled_transports(["tcp"], env={ENV: "nixl"}) == (TransportKind.TCP,)  # call wins


@pytest.mark.skipif(nixl_unavailable() is None, reason="NIXL is installed here")
def test_nixl_named_where_it_is_not_installed_is_refused() -> None:
    with pytest.raises(NoUsableTransport, match="NIXL is not installed"):
        enabled_transports(["nixl"])


@pytest.mark.skipif(
    os.environ.get("TENSORHUB_REQUIRE_NIXL") != "1", reason="not under make test (it sets it)"
)
def test_make_test_runs_the_nixl_tests() -> None:
    """`make setup` installs NIXL, so under `make test` its tests run instead of skipping."""
    assert nixl_unavailable() is None
