"""`tensorhub tenant create NAME`: an admin call that prints the new tenant's token once;
`tensorhub tenant delete NAME`: an admin call that deletes a tenant and everything it owns
(its name may then be created again, with tokens the old tenant's never match)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TypeVar

import grpc

from ros.cli.common import add_hub_flags, hub_stub, print_json
from ros.errors import from_rpc_error
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument

T = TypeVar("T")


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    create = sub.add_parser("create", help="create a tenant and print its token (shown once)")
    create.add_argument("name", help="tenant name ([a-z0-9][a-z0-9._-]{0,62})")
    add_hub_flags(create, tenant=False)
    create.add_argument(
        "--admin-token",
        default=os.environ.get("TENSORHUB_ADMIN_TOKEN"),
        help="the hub's admin token (env TENSORHUB_ADMIN_TOKEN)",
    )
    create.add_argument("--max-models", type=int, default=0, help="quota (default 64)")
    create.add_argument("--max-retained-versions", type=int, default=0, help="quota (default 4)")
    create.add_argument("--max-sessions", type=int, default=0, help="quota (default 1024)")
    create.add_argument(
        "--max-etcd-bytes", type=int, default=0,
        help="quota: live manifest bytes the tenant may hold in etcd (default 268435456)",
    )  # fmt: skip
    create.add_argument(
        "--max-publishes-per-minute", type=int, default=0,
        help="quota: publishes per minute, across every hub replica (default 600)",
    )  # fmt: skip
    create.add_argument(
        "--max-history-bytes", type=int, default=0,
        help="quota: bytes the tenant's publishes may write into etcd's history per "
        "compaction interval, across every hub replica (default: --max-etcd-bytes)",
    )  # fmt: skip
    delete = sub.add_parser(
        "delete", help="delete a tenant: its models, versions, holders and sessions, at once"
    )
    delete.add_argument("name", help="the tenant to delete")
    add_hub_flags(delete, tenant=False)
    delete.add_argument(
        "--admin-token",
        default=os.environ.get("TENSORHUB_ADMIN_TOKEN"),
        help="the hub's admin token (env TENSORHUB_ADMIN_TOKEN)",
    )


def run(args: argparse.Namespace) -> int:
    if not args.admin_token:
        raise InvalidArgument("no admin token: pass --admin-token or set TENSORHUB_ADMIN_TOKEN")
    if args.action == "delete":
        delete = pb.DeleteTenantRequest(name=args.name)
        deleted = _admin_call(args, lambda stub, **call: stub.DeleteTenant(delete, **call))
        if args.json:
            print_json({"tenant": args.name, "deleted": True, "revision": deleted.revision})
        else:
            print(f"tenant {args.name} deleted (revision {deleted.revision})")
        return 0
    request = pb.CreateTenantRequest(
        name=args.name,
        quotas=pb.Quotas(
            max_models=args.max_models,
            max_retained_versions=args.max_retained_versions,
            max_sessions=args.max_sessions,
            max_etcd_bytes=args.max_etcd_bytes,
            max_publishes_per_minute=args.max_publishes_per_minute,
            max_history_bytes=args.max_history_bytes,
        ),
    )
    created = _admin_call(args, lambda stub, **call: stub.CreateTenant(request, **call))
    if created.warning:
        print(f"warning: {created.warning}", file=sys.stderr)
    if args.json:
        print_json({"tenant": created.name, "token": created.token, "warning": created.warning})
    else:
        print(f"tenant {created.name} created. Its token (shown only now, store it safely):")
        print(created.token)
    return 0


def _admin_call(args: argparse.Namespace, rpc: Callable[..., T]) -> T:
    """`rpc(stub, timeout=, metadata=)`: one admin call with the admin token and the CLI's
    deadline; its errors as TensorHubErrors."""
    stub, channel = hub_stub(args)
    try:
        return rpc(
            stub,
            timeout=args.timeout,
            metadata=(("authorization", f"Bearer {args.admin_token}"),),
        )
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None
    finally:
        channel.close()
