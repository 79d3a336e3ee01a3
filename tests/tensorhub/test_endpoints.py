"""The one endpoint validator (`tensorhub.endpoints`) the hub and the SDK reader share."""

from __future__ import annotations

import pytest

from tensorhub.endpoints import (
    MAX_ENDPOINT_LENGTH,
    format_endpoint,
    parse_endpoint,
    validate_endpoints,
)
from tensorhub.errors import InvalidArgument

GOOD = {
    "127.0.0.1:1": ("127.0.0.1", 1),
    "10.0.0.7:65535": ("10.0.0.7", 65535),
    "[::1]:9000": ("::1", 9000),
    "[fe80::1%eth0]:80": ("fe80::1%eth0", 80),
    "localhost:8080": ("localhost", 8080),
    "node-7.rack-2.example.com:443": ("node-7.rack-2.example.com", 443),
    "trailing.dot.:5": ("trailing.dot.", 5),
}

BAD = [
    "",
    "not an endpoint",
    "127.0.0.1:99999",
    ":80",
    "host:",
    "host",
    "host:0",
    "host:-1",
    "host:+80",
    "host: 80",
    "host:\uff18\uff10",  # fullwidth digits are digits to str.isdigit, not to a socket
    "::1:80",  # unbracketed IPv6
    "[::1:80",
    "[1.2.3.4]:80",  # brackets are for IPv6 only
    "999.1.1.1:80",
    "1.2.3:80",
    "-leading.hyphen:80",
    "double..dot:80",
    "under_score:80",
    "a" * 64 + ".example:80",  # a label over 63 characters
    ("a" * 60 + ".") * 5 + "com:80",  # a hostname over 253 characters
    "x" * MAX_ENDPOINT_LENGTH + ":80",
]


@pytest.mark.parametrize("address", sorted(GOOD))
def test_good_endpoints_parse(address: str) -> None:
    assert parse_endpoint(address) == GOOD[address]


@pytest.mark.parametrize("address", BAD)
def test_bad_endpoints_are_refused_with_a_reason(address: str) -> None:
    with pytest.raises(InvalidArgument, match="invalid endpoint"):
        parse_endpoint(address)


def test_a_long_endpoint_is_quoted_short() -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_endpoint("x" * 400 + ":1")
    assert len(str(info.value)) < 200


def test_format_brackets_ipv6_and_round_trips() -> None:
    assert format_endpoint("::1", 5) == "[::1]:5"
    assert format_endpoint("127.0.0.1", 5) == "127.0.0.1:5"
    assert parse_endpoint(format_endpoint("fe80::2", 7)) == ("fe80::2", 7)
    with pytest.raises(InvalidArgument):
        format_endpoint("127.0.0.1", 0)


def test_endpoint_maps_need_known_kinds_and_one_entry() -> None:
    assert validate_endpoints({"tcp": "h:1", "rdma": "h:2"}) == {"tcp": "h:1", "rdma": "h:2"}
    for endpoints in ({}, {"udp": "h:1"}, {"tcp": "h:1", "rdma": "h:"}):
        with pytest.raises(InvalidArgument):
            validate_endpoints(endpoints)
