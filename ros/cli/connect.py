"""The SDK client of the commands that move weights (`publish`, `fetch`).

They hold and serve a version, so they connect with the SDK (a session, a holder server)
rather than with a bare stub like the read-only commands. Credentials and the hub come from
the same flags and `TENSORHUB_*` variables as every other command (`ros.cli.common`); the
holder server's address from `--listen` / `--advertise` (env `TENSORHUB_LISTEN`,
`TENSORHUB_ADVERTISE`): the default serves only this machine's loopback, so readers on other
machines need `--listen 0.0.0.0:PORT --advertise THIS_HOST:PORT`.
"""

from __future__ import annotations

import argparse
import os

import ros
from ros.cli.common import add_hub_flags
from ros.client.hub import Hub
from tensorhub.errors import InvalidArgument
from transport.tls import TlsConfig


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    add_hub_flags(parser)
    parser.add_argument(
        "--listen",
        default=os.environ.get("TENSORHUB_LISTEN", "127.0.0.1:0"),
        help="HOST:PORT this process serves the version's bytes on (env TENSORHUB_LISTEN; "
        "default %(default)s: this machine only)",
    )
    parser.add_argument(
        "--advertise",
        default=os.environ.get("TENSORHUB_ADVERTISE"),
        help="HOST:PORT readers reach it at, when not the --listen address (env "
        "TENSORHUB_ADVERTISE)",
    )
    parser.add_argument(
        "--name", default=None, help="holder name in the hub's records (default HOST-PID-RANDOM)"
    )


def check_credentials(args: argparse.Namespace) -> None:
    """`InvalidArgument` now, before any connection, if the hub or a credential is missing."""
    if not args.hub:
        raise InvalidArgument("no hub address: pass --hub HOST:PORT or set TENSORHUB_HUB")
    if not args.tenant:
        raise InvalidArgument("no tenant: pass --tenant or set TENSORHUB_TENANT")
    if not args.token:
        raise InvalidArgument("no tenant token: pass --token or set TENSORHUB_TOKEN")


def connect(args: argparse.Namespace) -> Hub:
    """An SDK client for the tenant, its holder server bound to `--listen`."""
    check_credentials(args)
    return ros.connect(
        [a for a in args.hub.split(",") if a],
        tenant=args.tenant,
        token=args.token,
        listen=args.listen,
        advertise=args.advertise,
        name=args.name,
        timeout=args.timeout,
        tls=TlsConfig(ca=args.tls_ca) if args.tls_ca else None,
    )
