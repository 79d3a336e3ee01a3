"""Pieces the CLI commands share: connection flags from the environment, JSON/table output."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from ros.client.channel import open_channel
from ros.proto.tensorhub.v1 import hub_pb2_grpc
from tensorhub.errors import InvalidArgument
from transport.tls import TlsConfig


def add_hub_flags(parser: argparse.ArgumentParser, *, tenant: bool = True) -> None:
    parser.add_argument(
        "--hub",
        default=os.environ.get("TENSORHUB_HUB"),
        help="hub address(es) HOST:PORT[,HOST:PORT] (env TENSORHUB_HUB)",
    )
    if tenant:
        parser.add_argument(
            "--tenant", default=os.environ.get("TENSORHUB_TENANT"), help="env TENSORHUB_TENANT"
        )
        parser.add_argument(
            "--token", default=os.environ.get("TENSORHUB_TOKEN"), help="env TENSORHUB_TOKEN"
        )
    parser.add_argument(
        "--tls-ca",
        default=os.environ.get("TENSORHUB_TLS_CA"),
        help="CA certificate (PEM) of a TLS hub (env TENSORHUB_TLS_CA)",
    )
    parser.add_argument(
        "--timeout", type=float, default=10.0, help="deadline of each call, seconds"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def hub_stub(args: argparse.Namespace) -> tuple[hub_pb2_grpc.TensorHubStub, Any]:
    if not args.hub:
        raise InvalidArgument("no hub address: pass --hub HOST:PORT or set TENSORHUB_HUB")
    tls = TlsConfig(ca=args.tls_ca) if args.tls_ca else None
    channel = open_channel([a for a in args.hub.split(",") if a], tls=tls)
    return hub_pb2_grpc.TensorHubStub(channel), channel  # type: ignore[no-untyped-call]


def tenant_metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    if not args.token:
        raise InvalidArgument("no tenant token: pass --token or set TENSORHUB_TOKEN")
    metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {args.token}"),)
    if getattr(args, "tenant", None):  # the hub refuses a token of another tenant
        metadata += (("tensorhub-tenant", str(args.tenant)),)
    return metadata


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
