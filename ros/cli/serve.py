"""`tensorhub serve`: run one hub replica until SIGINT/SIGTERM.

Without `--etcd`, starts one embedded etcd member in a temporary directory (development),
with etcd auth on and a root password only this process knows (`consistency.embedded`),
that ends with this process even when it is killed with SIGKILL;
with `--etcd`, the `--etcd-*` options (or `TENSORHUB_ETCD_*`) give its user, password and TLS;
without `--admin-token`, generates one and prints it. Several replicas over the same etcd
(and the same `--prefix`) serve the same data; any of them can serve any client.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import sys
import threading
from pathlib import Path

import grpc

from consistency import EtcdCluster, Keys
from consistency.compactor import DEFAULT_INTERVAL as DEFAULT_COMPACT_INTERVAL
from consistency.credentials import add_etcd_arguments, credentials_from_args
from consistency.keys import DEFAULT_PREFIX
from ros.hub import collector
from ros.hub.guard import DEFAULT_FIRST_MESSAGE_SECONDS
from ros.hub.limits import (
    DEFAULT_MAX_PRIVATE_WATCHES,
    DEFAULT_MAX_PRIVATE_WATCHES_PER_TENANT,
    DEFAULT_MAX_STREAMS,
    DEFAULT_MAX_STREAMS_PER_TENANT,
    DEFAULT_MAX_WATCHED_MODELS_PER_TENANT,
    DEFAULT_WORKERS,
)
from ros.hub.server import DEFAULT_MAX_STREAMS_PER_CONNECTION, HubServer
from ros.hub.state import DEFAULT_ETCD_QUOTA_BYTES
from ros.metrics_http import MetricsServer
from ros.tokens import MAX_READ_TOKEN_LIFETIME, READ_KEY_PERIOD, READ_TOKEN_TTL
from tensorhub.errors import InvalidArgument, TensorHubError

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument(
        "--listen",
        default="127.0.0.1:7600",
        help="HOST:PORT to serve gRPC on (default %(default)s)",
    )
    parser.add_argument(
        "--etcd",
        help="etcd endpoints HOST:PORT[,HOST:PORT] (https://HOST:PORT with --etcd-ca); "
        "default: start an embedded member with auth on",
    )
    add_etcd_arguments(parser)
    parser.add_argument(
        "--admin-token",
        help="admin token for tenant creation; shows in `ps`, so prefer the environment "
        "variable TENSORHUB_ADMIN_TOKEN or --admin-token-file (a warning is logged); "
        "default: TENSORHUB_ADMIN_TOKEN, else generate and print one",
    )
    parser.add_argument(
        "--admin-token-file",
        type=Path,
        metavar="PATH",
        help="read the admin token from this file (its first line)",
    )
    parser.add_argument(
        "--prefix", default=DEFAULT_PREFIX, help="etcd key prefix (default %(default)s)"
    )
    parser.add_argument(
        "--retain",
        type=int,
        default=2,
        help="versions kept readable per model (default %(default)s)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port (off unless given; 0: a free port, "
        'printed and written to --ready-file as "metrics")',
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics port binds to; it needs no token, so the default is "
        "loopback: give the scraper's interface, or 0.0.0.0 for every one (default "
        "%(default)s)",
    )
    parser.add_argument("--tls-cert", type=Path, help="PEM certificate chain: serve TLS")
    parser.add_argument("--tls-key", type=Path, help="PEM private key for --tls-cert")
    parser.add_argument(
        "--max-streams",
        type=int,
        default=DEFAULT_MAX_STREAMS,
        help="KeepAlive and Watch streams this replica serves at once; past it a new stream "
        "is refused at once with Overloaded (RESOURCE_EXHAUSTED) (default %(default)s)",
    )
    parser.add_argument(
        "--max-streams-per-tenant",
        type=int,
        default=DEFAULT_MAX_STREAMS_PER_TENANT,
        help="streams one tenant may hold open on this replica, so no tenant can take every "
        "slot (default %(default)s)",
    )
    parser.add_argument(
        "--max-private-watches",
        type=int,
        default=DEFAULT_MAX_PRIVATE_WATCHES,
        help="watches replaying history from an old revision at once (each has its own etcd "
        "watch) (default %(default)s)",
    )
    parser.add_argument(
        "--max-private-watches-per-tenant",
        type=int,
        default=DEFAULT_MAX_PRIVATE_WATCHES_PER_TENANT,
        help="of those, how many one tenant may run at once on this replica; past it its "
        "replay is refused with Overloaded (default %(default)s)",
    )
    parser.add_argument(
        "--max-watched-models-per-tenant",
        type=int,
        default=DEFAULT_MAX_WATCHED_MODELS_PER_TENANT,
        help="distinct model names one tenant may watch at once on this replica (each costs "
        "an etcd watcher; more streams on a watched model are free); past it a Watch of "
        "another name is refused with Overloaded (default %(default)s)",
    )
    parser.add_argument(
        "--first-message-timeout",
        type=float,
        default=DEFAULT_FIRST_MESSAGE_SECONDS,
        metavar="SECONDS",
        help="a call whose first request message has not come by then is ended with "
        "DeadlineExceeded (every method, health checks too) (default %(default)s)",
    )
    parser.add_argument(
        "--max-streams-per-connection",
        type=int,
        default=DEFAULT_MAX_STREAMS_PER_CONNECTION,
        help="HTTP/2 streams one client connection may have open at once; past it a client "
        "queues its calls (default %(default)s)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=DEFAULT_WORKERS,
        help="threads running unary calls (streams need none) (default %(default)s)",
    )
    parser.add_argument(
        "--check-processes",
        type=int,
        default=1,
        help="processes checking the manifests of PublishShards calls beside the event loop, "
        "on cores of their own (0: the replica checks them itself) (default %(default)s)",
    )
    parser.add_argument(
        "--read-key-period",
        type=float,
        default=READ_KEY_PERIOD,
        metavar="SECONDS",
        help="seconds between rotations of each tenant's read key; holders accept the "
        "current and the previous period's; the same on every replica (default %(default)s)",
    )
    parser.add_argument(
        "--read-token-ttl",
        type=float,
        default=READ_TOKEN_TTL,
        metavar="SECONDS",
        help="seconds a read token issued at Resolve lives; fetches renew theirs before it "
        f"expires; at most {MAX_READ_TOKEN_LIFETIME:g} (default %(default)s)",
    )
    parser.add_argument(
        "--compact-interval",
        type=float,
        default=DEFAULT_COMPACT_INTERVAL,
        metavar="SECONDS",
        help="seconds between etcd compactions, done by the one replica elected for it; it "
        "compacts behind the revision seen one interval earlier, defragments when that pays "
        "and disarms a NOSPACE alarm once space is free (0: off) (default %(default)s)",
    )
    parser.add_argument(
        "--etcd-quota-bytes",
        type=int,
        default=DEFAULT_ETCD_QUOTA_BYTES,
        metavar="BYTES",
        help="etcd's --quota-backend-bytes: `tenant create` warns when the tenants' etcd "
        "budgets (live bytes plus the history they may write per compaction interval) add "
        "up to more (default %(default)s, etcd's own default)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=2.0,
        help="seconds open calls get to finish on SIGINT/SIGTERM before they are cancelled "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--ready-file",
        type=Path,
        help="write the bound address and etcd endpoints here as JSON once serving",
    )


def _admin_token(args: argparse.Namespace) -> tuple[str, bool]:
    """The admin token (--admin-token, --admin-token-file, TENSORHUB_ADMIN_TOKEN, in that
    order, else a new one) and whether it was generated (then it is printed once)."""
    if args.admin_token:
        log.warning(
            "--admin-token on the command line is visible to every local user (ps, "
            "/proc/*/cmdline): use TENSORHUB_ADMIN_TOKEN or --admin-token-file instead"
        )
        return str(args.admin_token), False
    if args.admin_token_file:
        lines = args.admin_token_file.read_text().splitlines()
        token = lines[0].strip() if lines else ""
        if not token:
            raise InvalidArgument(f"--admin-token-file {args.admin_token_file} is empty")
        return token, False
    from_env = os.environ.get("TENSORHUB_ADMIN_TOKEN")
    if from_env:
        return from_env, False
    return secrets.token_urlsafe(24), True


def write_ready_file(path: Path, content: dict[str, object]) -> None:
    """Write the ready file whole or not at all: a watcher that polls for the file must never
    read it between its creation and its content (a temporary name, then a rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(content))
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> int:
    try:
        admin_token, generated = _admin_token(args)
    except (OSError, TensorHubError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    embedded: EtcdCluster | None = None
    try:
        etcd_credentials = credentials_from_args(args)
    except TensorHubError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.etcd:
        endpoints = [e for e in args.etcd.split(",") if e]
    else:
        if etcd_credentials is not None:
            print("warning: --etcd-* credentials are for --etcd; ignored", file=sys.stderr)
        embedded = EtcdCluster(size=1, auth=True).start()
        endpoints, etcd_credentials = embedded.endpoints, embedded.credentials
        print(
            f"embedded etcd at {endpoints[0]} (data in {embedded.root}; auth on, its root "
            "password known only to this process)",
            flush=True,
        )
    credentials = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            print("error: --tls-cert and --tls-key go together", file=sys.stderr)
            return 2
        credentials = grpc.ssl_server_credentials(
            [(args.tls_key.read_bytes(), args.tls_cert.read_bytes())]
        )
    try:
        metrics = None
        if args.metrics_port is not None:  # bound first: a taken port stops nothing half-started
            try:  # one thread, a deadline per connection (ros/metrics_http.py)
                metrics = MetricsServer(args.metrics_host.strip("[]"), args.metrics_port)
            except (OSError, TensorHubError) as exc:
                print(
                    f"error: --metrics-host {args.metrics_host} --metrics-port "
                    f"{args.metrics_port}: {exc}",
                    file=sys.stderr,
                )
                return 2
        server = HubServer(
            endpoints, listen=args.listen, admin_token=admin_token, keys=Keys(args.prefix),
            retain=args.retain, credentials=credentials, max_workers=args.workers,
            max_streams=args.max_streams, max_streams_per_tenant=args.max_streams_per_tenant,
            max_private_watches=args.max_private_watches,
            max_private_watches_per_tenant=args.max_private_watches_per_tenant,
            max_watched_models_per_tenant=args.max_watched_models_per_tenant,
            compact_interval=args.compact_interval, read_key_period=args.read_key_period,
            etcd_quota_bytes=args.etcd_quota_bytes,
            read_token_ttl=args.read_token_ttl, etcd_credentials=etcd_credentials,
            first_message_seconds=args.first_message_timeout,
            max_streams_per_connection=args.max_streams_per_connection,
            check_processes=args.check_processes,
        ).start()  # fmt: skip
        collector.tune()  # a burst's garbage is short-lived (ros/hub/collector.py)
        ready: dict[str, object] = {"address": server.address, "etcd": endpoints}
        if metrics is not None:
            metrics.start()
            host, port = metrics.address
            ready["metrics"] = f"{host}:{port}"
        # Handlers before anything says "ready": a SIGTERM sent as soon as the ready file
        # appears must stop the hub gracefully, not kill it by default.
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"hub serving on {server.address}", flush=True)
        if metrics is not None:
            print(f"metrics on http://{ready['metrics']}/metrics", flush=True)
        if generated:
            print(f"admin token: {admin_token}", flush=True)
        if args.ready_file:
            write_ready_file(args.ready_file, ready)
        # Not a bare wait: Python runs a signal's handler in the main thread only when that
        # thread runs bytecode, and the kernel may deliver SIGTERM to one of gRPC's threads,
        # which does not wake a main thread blocked on a lock. A CI run found a serve still
        # waiting here hours after its SIGTERM; a timed wait runs the handler within a second.
        while not stop.wait(1.0):
            pass
        print("shutting down", flush=True)
        if metrics is not None:
            metrics.close()
        server.stop(grace=args.grace)
    finally:
        if embedded is not None:
            embedded.stop()
    return 0
