"""The gRPC channel to the hub: several replicas, spread, failover and retries.

All replica addresses (every IP each name resolves to) go into one channel target
(`ipv4:a:p,b:p`) with `pick_first`: one replica at a time carries all of a client's calls
and its streams (KeepAlive and Watch need one replica at once), and when that one fails the
channel moves to the next in the list. The list is **shuffled per channel**: in the order
given, every client of a job would take the first replica while the others idled, and when
it died they would all move to the same next one. A random order per client puts N clients
on each of R replicas about N/R at a time, and the clients of a replica that dies go on to
the others evenly (each has its own second choice). `pick_first` follows the list even when
another channel of the process is already connected to a later address (the subchannel is
shared, the choice is not: checked on grpcio 1.62 and 1.85), so clients of one process
spread too. `shuffle=False` keeps the given order, and `rng` makes the order reproducible
(tests); the default is the `random` module's, which is reseeded in a forked child so forked
ranks do not share one order. `pick_first` is sticky: a replica that comes back gets new
clients, and those whose own replica fails, not the ones that moved away.

Reconnecting is spread in time as well: gRPC jitters its reconnect backoff
(`grpc.initial_reconnect_backoff_ms`, ±20 %), and the SDK retries a call and reopens a
broken stream after a full-jitter backoff (`ros.client.rpc`, `ros.client.lease`,
`ros.client.watch`), so the clients of a dead replica do not arrive at the others in one
instant.

The service config declares **no `retryPolicy`**: every retry of the SDK is a
`consistency.retry.RetryPolicy` (one layer: `ros.client.rpc.UNARY_POLICY` for a plain
idempotent call, the client's `retry` for fresh reads, `ros.client.session` for OpenSession
and recovery, `ros.client.publishing` for Publish), so no call is retried by gRPC underneath
a policy that retries it too (docs/design-notes.md, "One retry layer"). gRPC's transparent
retry of a call that never reached the wire stays: it sends nothing twice.
"""

from __future__ import annotations

import ipaddress
import json
import random
import socket
from collections.abc import Sequence
from pathlib import Path

import grpc

from tensorhub.endpoints import parse_endpoint
from tensorhub.errors import InvalidArgument
from transport.tls import TlsConfig

SERVICE = "tensorhub.v1.TensorHub"
SERVICE_CONFIG = json.dumps({"loadBalancingConfig": [{"pick_first": {}}]})


def parse_address(address: str, *, allow_zero: bool = False) -> tuple[str, int]:
    """`host:port` (or `[v6]:port`) → (host, port); `InvalidArgument` for anything else.

    The rules are the holder endpoints' (`tensorhub.endpoints`), one parser for both.
    Port 0 ("pick a free one") is accepted only where we bind, with `allow_zero`.
    """
    if allow_zero and isinstance(address, str) and address.endswith(":0"):
        host, _ = parse_endpoint(address[:-1] + "1")  # the host's rules, then port 0
        return host, 0
    return parse_endpoint(address)


def channel_target(
    endpoints: Sequence[str], *, shuffle: bool = True, rng: random.Random | None = None
) -> str:
    """One target naming every replica by IP, for `pick_first` failover across them, in a
    random order (`rng`, or the `random` module's) unless `shuffle` is False: the order
    decides which replica this channel uses first and where it goes when that one fails."""
    if not endpoints:
        raise InvalidArgument("at least one hub address is needed")
    v4: list[str] = []
    v6: list[str] = []
    for address in endpoints:
        host, port = parse_address(address)
        for ip in _resolve(host):
            if ipaddress.ip_address(ip).version == 4:
                v4.append(f"{ip}:{port}")
            else:
                v6.append(f"[{ip}]:{port}")
    scheme, addresses = ("ipv4", v4) if v4 else ("ipv6", v6)
    addresses = list(dict.fromkeys(addresses))
    if shuffle:
        (rng or random).shuffle(addresses)
    return f"{scheme}:" + ",".join(addresses)


def _resolve(host: str) -> list[str]:
    try:
        ipaddress.ip_address(host)
        return [host]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise InvalidArgument(f"cannot resolve hub host {host!r}: {exc}") from exc
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def open_channel(
    endpoints: Sequence[str],
    *,
    tls: TlsConfig | None = None,
    tls_server_name: str | None = None,
    shuffle: bool = True,
    rng: random.Random | None = None,
) -> grpc.Channel:
    """A channel to every replica, tried in a random order per channel (`channel_target`);
    with `tls`, verified against its CA (and presenting our certificate, for hubs that
    require client certificates)."""
    options: list[tuple[str, object]] = [
        ("grpc.service_config", SERVICE_CONFIG),
        ("grpc.enable_retries", 1),
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
    ]
    target = channel_target(endpoints, shuffle=shuffle, rng=rng)
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(tls.ca).read_bytes(),
        private_key=Path(tls.key).read_bytes() if tls.key else None,
        certificate_chain=Path(tls.cert).read_bytes() if tls.cert else None,
    )
    return grpc.secure_channel(target, credentials, options=options)
