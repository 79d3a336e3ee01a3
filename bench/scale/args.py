"""`tensorhub bench scale`'s flags: the parts (`PARTS`) and every knob of each part, with
their defaults (the scale envelope's sizes: docs/design.md).

Apart from the runners (`bench.scale.runners`) and the report (`bench.scale.rows`): one
list of flags, read by `bench.scale.cli.parse` for `tensorhub bench scale` and by
`tensorhub bench all`.
"""

from __future__ import annotations

import argparse

PARTS = ("clients", "holders", "manifest", "history", "shards", "herd", "reconnect")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated subset of: " + ", ".join(PARTS)
    )
    ap.add_argument(
        "--clients",
        default="100,500,1000,2000",
        help="clients per replica, one round each (default %(default)s)",
    )
    ap.add_argument("--versions", type=int, default=20, help="versions published per round")
    ap.add_argument("--gap", type=float, default=0.2, help="seconds between publishes")
    ap.add_argument("--workers", type=int, default=4, help="client processes")
    ap.add_argument("--ttl", type=int, default=10, help="client session TTL (s)")
    ap.add_argument(
        "--connect-seconds",
        type=float,
        default=120.0,
        help="deadline for a round's clients to connect",
    )
    ap.add_argument("--hub-tree", help="run the hub of another checkout (e.g. a worktree)")
    ap.add_argument("--holders", default="16,1024", help="SMALL,LARGE holders of one version")
    ap.add_argument("--manifest-tensors", type=int, default=100_000)
    ap.add_argument("--manifest-chunks", type=int, default=300_000)
    ap.add_argument("--history-steps", type=int, default=10_000)
    ap.add_argument(
        "--history-seconds",
        type=float,
        default=300.0,
        help="the history part stops here even if steps remain",
    )
    ap.add_argument(
        "--history-sample-every", type=int, default=1000, help="steps between DB size samples"
    )
    ap.add_argument(
        "--compact-interval",
        type=float,
        default=5.0,
        help="the hub's --compact-interval in the history part",
    )
    ap.add_argument("--shards", type=int, default=4096, help="shards of the in-flight case")
    ap.add_argument("--inflight", type=int, default=256, help="its shard publishes in flight")
    ap.add_argument(
        "--ranks", type=int, default=1024, help="ranks of the barrier case (a session each)"
    )
    ap.add_argument(
        "--sequential",
        type=int,
        default=4096,
        help="shards of the sequential case (one client, one after another)",
    )
    ap.add_argument(
        "--group-tensors",
        type=int,
        default=200,
        help="tensors in each shard's manifest in the group cases (a transformer layer's)",
    )
    ap.add_argument(
        "--group-frame",
        type=int,
        default=32,
        help="shards a message of the group cases' call (1: one a message, what a hub "
        "without PublishRequest.shards reads, e.g. with --hub-tree of such a tree)",
    )
    ap.add_argument(
        "--shard-cases",
        default="ranks,inflight,sequential,group-shards,group-ranks",
        help="cases of the shards part (default %(default)s)",
    )
    ap.add_argument(
        "--shard-timeout", type=float, default=600.0, help="deadline of one shard's Publish (s)"
    )
    ap.add_argument(
        "--replicas",
        default="1,2",
        help="hub replicas of the shards and herd parts, one run each (default %(default)s)",
    )
    ap.add_argument("--herd-clients", type=int, default=2000, help="clients opening at once")
    ap.add_argument(
        "--herd-hold",
        type=float,
        default=None,
        help="seconds the herd stays open after its last open (default: --ttl)",
    )
    ap.add_argument(
        "--herd-open-seconds",
        type=float,
        default=10.0,
        help="deadline of one OpenSession in the herd (default: the SDK's timeout, 10 s)",
    )
    ap.add_argument(
        "--reconnect-clients", type=int, default=2000, help="SDK clients under the killed replica"
    )
    ap.add_argument(
        "--reconnect-workers", type=int, default=8, help="processes holding the SDK clients"
    )
    ap.add_argument(
        "--reconnect-connecting",
        type=int,
        default=8,
        help="SDK clients connecting and publishing at a time, in all (the setup is paced)",
    )
    ap.add_argument(
        "--reconnect-observe",
        type=float,
        default=None,
        help="seconds watched after the kill (default: --ttl + 5)",
    )
    ap.add_argument(
        "--max-txn-ops", type=int, default=128, help="etcd's --max-txn-ops (its default)"
    )
    ap.add_argument(
        "--max-request-bytes",
        type=int,
        default=1_572_864,
        help="etcd's --max-request-bytes (its default, 1.5 MiB)",
    )
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON (- = stdout)")
