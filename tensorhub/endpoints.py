"""Holder endpoints: the one validator the hub (before any write) and the SDK reader share.

A holder record advertises one endpoint per transport kind. Every known kind is a
`HOST:PORT` a reader connects to over TCP:

- `tcp`: the holder's data-plane server;
- `rdma`: the TCP control channel over which the RDMA queue-pair handshake runs
  (`transport/rdma/`; queue-pair numbers, GIDs and keys travel on that channel, never in
  the record);
- `ipc`: the TCP control channel over which a reader on the same host is granted a lease on
  the holder's GPU memory through CUDA IPC (`transport/ipc/`; handles travel on that
  channel, only after the read token passed, never in the record);
- `nixl`: the TCP control channel of a NIXL holder (`transport/nixl/`; its agent metadata
  and memory regions travel on that channel, only after the read token passed, never in
  the record).

HOST is a DNS hostname (RFC 1123 labels), a dotted IPv4 address or a bracketed IPv6
address (`[::1]:9000`); PORT is a decimal number in 1..65535. Anything else, such as
`"not an endpoint"`, `"127.0.0.1:99999"`, `":80"` or `"host:"`, is refused with
`InvalidArgument`: a record the hub accepted must be one every reader can use, or one bad
endpoint makes every fetch of that version fail although a good holder exists.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Mapping

from tensorhub.errors import InvalidArgument

KINDS = ("tcp", "rdma", "ipc", "nixl")  # the transport kinds a holder record may name
MAX_ENDPOINTS = len(KINDS)
MAX_ENDPOINT_LENGTH = 512  # characters of one endpoint (a hostname is at most 253)
MAX_HOSTNAME_LENGTH = 253
ENDPOINTS_REMEMBERED = 16384  # endpoints that passed, kept (`parse_endpoint`)

_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_PORT = re.compile(r"[0-9]{1,5}")


def parse_endpoint(address: str) -> tuple[str, int]:
    """`HOST:PORT` → (host, port), brackets of an IPv6 host removed; `InvalidArgument`
    (saying what is wrong) for anything a reader could not connect to. The last
    `ENDPOINTS_REMEMBERED` endpoints that passed answer from memory: a hub validates every
    rank's endpoint at every shard publish, the same few thousand at every step (an
    IPv4 endpoint's parse costs about 2.7 µs, 0.1 µs remembered)."""
    if not isinstance(address, str) or not address or len(address) > MAX_ENDPOINT_LENGTH:
        raise InvalidArgument(f"invalid endpoint {_shown(address)}: expected HOST:PORT")
    return _parse(address)


@functools.lru_cache(maxsize=ENDPOINTS_REMEMBERED)
def _parse(address: str) -> tuple[str, int]:
    """`parse_endpoint` of a string of at most `MAX_ENDPOINT_LENGTH` characters (only
    those that pass are remembered: a refusal raises)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise InvalidArgument(f"invalid endpoint {_shown(address)}: expected HOST:PORT")
    if not _PORT.fullmatch(port) or not 1 <= int(port) <= 65535:
        raise InvalidArgument(f"invalid endpoint {_shown(address)}: port must be 1..65535")
    return _check_host(host, address), int(port)


def format_endpoint(host: str, port: int) -> str:
    """The endpoint for (host, port), bracketing an IPv6 address; validated."""
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    address = f"{shown}:{port}"
    parse_endpoint(address)
    return address


def validate_endpoints(endpoints: Mapping[str, str]) -> dict[str, str]:
    """Check a holder's endpoint map: at least one, known kinds only, each one valid.

    Returns a plain copy; raises `InvalidArgument` naming the first bad entry.
    """
    if not endpoints:
        raise InvalidArgument(f"a holder needs an endpoint (one of {', '.join(KINDS)})")
    if len(endpoints) > MAX_ENDPOINTS:
        raise InvalidArgument(f"too many holder endpoints: {len(endpoints)} > {MAX_ENDPOINTS}")
    for kind, address in endpoints.items():
        if kind not in KINDS:
            raise InvalidArgument(
                f"unknown endpoint kind {_shown(kind)}: expected one of {', '.join(KINDS)}"
            )
        parse_endpoint(address)
    return dict(endpoints)


def _check_host(host: str, address: str) -> str:
    if host.startswith("[") or host.endswith("]"):
        inner = host[1:-1] if host.startswith("[") and host.endswith("]") else ""
        try:
            if ipaddress.ip_address(inner).version == 6:
                return inner
        except ValueError:
            pass
        raise InvalidArgument(f"invalid endpoint {_shown(address)}: bad bracketed IPv6 host")
    if ":" in host:
        raise InvalidArgument(
            f"invalid endpoint {_shown(address)}: an IPv6 host must be bracketed, [addr]:port"
        )
    labels = host.removesuffix(".").split(".")
    if labels[-1].isdigit():  # all-numeric last label: an IPv4 address or nothing
        try:
            ipaddress.IPv4Address(host)
            return host
        except ValueError:
            raise InvalidArgument(f"invalid endpoint {_shown(address)}: bad IPv4 host") from None
    if len(host) > MAX_HOSTNAME_LENGTH or not all(_LABEL.fullmatch(x) for x in labels):
        raise InvalidArgument(
            f"invalid endpoint {_shown(address)}: host is no hostname, IPv4 or [IPv6]"
        )
    return host


def _shown(value: object) -> str:
    """The value as an error message quotes it: repr, cut short (a caller may send 512)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
