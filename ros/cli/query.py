"""`tensorhub ls`, `inspect MODEL@V`, `holders MODEL@V`: read-only views of a tenant's data."""

from __future__ import annotations

import argparse
import datetime
from typing import Any

import grpc

from ros.cli.common import add_hub_flags, hub_stub, print_json, print_table, tenant_metadata
from ros.cli.viewinfo import view_line, view_summary
from ros.errors import from_rpc_error
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument, VersionNotFound
from tensorhub.names import validate_name
from tensorhub.view_rules import view_model

_STATES = {pb.PARTIAL: "PARTIAL", pb.COMPLETE: "COMPLETE"}


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    if name in ("inspect", "holders"):
        parser.add_argument(
            "target", metavar="MODEL@V", help="a model and version (MODEL alone: latest)"
        )
        parser.add_argument(
            "--page-size",
            type=int,
            default=0,
            help="holders per request to the hub (default: the hub's, 500; at most 5000)",
        )
        parser.add_argument(
            "--view",
            metavar="FORMAT",
            help="this view of the version (fp8-block128, mxfp8): version V of MODEL.FORMAT",
        )
    add_hub_flags(parser)
    parser.set_defaults(query=name)


def parse_target(target: str) -> tuple[str, int]:
    model, sep, version = target.partition("@")
    validate_name(model, "model")
    if not sep or version == "latest":
        return model, 0
    if not version.isdigit() or int(version) <= 0:
        raise InvalidArgument(f"invalid version in {target!r}: expected MODEL@N with N > 0")
    return model, int(version)


def _call(args: argparse.Namespace, method: str, request: Any) -> Any:
    stub, channel = hub_stub(args)
    try:
        return getattr(stub, method)(request, timeout=args.timeout, metadata=tenant_metadata(args))
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, method) from None
    finally:
        channel.close()


def _inspect(args: argparse.Namespace, model: str, version: int) -> Any:
    """Inspect with every holder: the hub lists them in pages (of `--page-size`); follow them."""
    request = pb.InspectRequest(model=model, version=version, page_size=args.page_size)
    info = _call(args, "Inspect", request)
    request.version, request.omit_manifest = info.version, True
    while info.next_page_token:
        request.page_token = info.next_page_token
        page = _call(args, "Inspect", request)
        info.holders.extend(page.holders)
        info.next_page_token, info.revision = page.next_page_token, page.revision
    return info


def _holder_rows(holders: Any) -> list[dict[str, Any]]:
    return [
        {
            "name": h.name,
            "state": _STATES.get(h.state, "?"),
            "endpoints": dict(h.endpoints),
            "topology": dict(h.topology),
            "session": f"{h.session_id:x}",
            "fence": h.fence,
            "shard": h.shard if h.HasField("shard") else None,
        }
        for h in holders
    ]


def run(args: argparse.Namespace) -> int:
    if args.query == "ls":
        response = _call(args, "ListModels", pb.ListModelsRequest())
        models = [
            {"model": m.name, "latest": m.latest, "versions": list(m.versions)}
            for m in response.models
        ]
        if args.json:
            print_json({"models": models, "revision": response.revision})
        elif not models:
            print("no models")
        else:
            print_table(
                ["MODEL", "LATEST", "RETAINED VERSIONS"],
                [[m["model"], m["latest"], ",".join(map(str, m["versions"]))] for m in models],
            )
        return 0
    model, version = parse_target(args.target)
    if args.view is not None:
        model = view_model(model, args.view)
    info = _inspect(args, model, version)
    holders = _holder_rows(info.holders)
    parts = list(info.shards) or [info.manifest]  # a model-parallel version: one per shard
    delta = _delta(args, info.version, parts)
    if args.query == "holders":
        if args.json:
            print_json(
                {
                    "model": model,
                    "version": info.version,
                    "holders": holders,
                    "delta": delta,
                    "revision": info.revision,
                }
            )
            return 0
        _print_holders(holders)
        if delta is not None:
            print(f"\ndelta against {delta['base']}: served by the holders of "
                  f"{delta['companion']}@{info.version}")  # fmt: skip
            if delta["holders"] is None:
                print("  (gone: readers behind read the version whole)")
            else:
                _print_holders(delta["holders"])
        return 0
    data = {
        "model": model,
        "version": info.version,
        "latest": info.latest,
        "retained": info.retained,
        "published_revision": info.published_revision,
        "shards": len(info.shards),
        "tensors": sum(len(m.tensors) for m in parts),
        "bytes": sum(m.total_bytes for m in parts),
        "chunks": sum(len(m.chunk_xxh3) for m in parts),
        "chunk_size": parts[0].chunk_size,
        "holders": holders,
        "pins": list(info.pins),
        "delta": delta,
        "view": view_summary(model, info.manifest),
        "revision": info.revision,
    }
    if args.json:
        print_json(data)
        return 0
    print(f"{model}@{info.version}  (latest {info.latest}{', retained' if info.retained else ''})")
    print(f"  published at revision {info.published_revision}; read at revision {info.revision}")
    size, chunk = _size(data["bytes"]), _size(data["chunk_size"])
    shards = f" in {data['shards']} shards" if data["shards"] else ""
    print(f"  {data['tensors']} tensors{shards}, {size} in {data['chunks']} chunks of {chunk}")
    complete = sum(1 for h in holders if h["state"] == "COMPLETE")
    print(f"  holders: {len(holders)} ({complete} complete)")
    for h in holders:
        part = "" if h["shard"] is None else f" shard {h['shard']}"
        print(f"    {h['name']:<32} {h['state']:<8} {','.join(h['endpoints'].values())}{part}")
    if data["pins"]:
        print(f"  pinned by: {', '.join(data['pins'])}")
    if data["view"] is not None:
        print(f"  {view_line(data['view'], info.version)}")
    if delta is not None:
        share = delta["encoded_bytes"] / data["bytes"] if data["bytes"] else 0.0
        print(
            f"  delta against {delta['base']} ({delta['encoding']}): {delta['encoded_chunks']} "
            f"of {data['chunks']} chunks encoded, {_size(delta['encoded_bytes'])} "
            f"({share:.1%} of the version)"
        )
        if delta["holders"] is None:
            print(f"    served as {delta['companion']}@{info.version}: gone")
        else:
            print(f"    served as {delta['companion']}@{info.version} by "
                  f"{len(delta['holders'])} holders")  # fmt: skip
            for h in delta["holders"]:
                part = "" if h["shard"] is None else f" shard {h['shard']}"
                where = ",".join(h["endpoints"].values())
                print(f"      {h['name']:<30} {h['state']:<8} {where}{part}")
    print(f"  as of {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    return 0


def _print_holders(holders: list[dict[str, Any]]) -> None:
    sharded = any(h["shard"] is not None for h in holders)  # a model-parallel version
    print_table(
        ["HOLDER", *(["SHARD"] if sharded else []), "STATE", "ENDPOINT", "TOPOLOGY", "SESSION"],
        [
            [
                h["name"],
                *([h["shard"]] if sharded else []),
                h["state"],
                ",".join(f"{k}={v}" for k, v in h["endpoints"].items()),
                ",".join(f"{k}={v}" for k, v in sorted(h["topology"].items())) or "-",
                h["session"],
            ]
            for h in holders
        ],
    )


def _delta(args: argparse.Namespace, version: int, parts: list[Any]) -> dict[str, Any] | None:
    """The version's delta (over its shards) and the holders of its companion, which serve
    the encoded chunks (None holders: the companion is gone); None: published whole."""
    with_delta = [m.delta for m in parts if m.HasField("delta")]
    if not with_delta:
        return None
    companion = with_delta[0].companion
    try:
        holders: list[dict[str, Any]] | None = _holder_rows(
            _inspect(args, companion, version).holders
        )
    except VersionNotFound:
        holders = None
    return {
        "base": with_delta[0].base,
        "encoding": with_delta[0].encoding,
        "companion": companion,
        "encoded_chunks": sum(sum(1 for n in d.encoded_bytes if n) for d in with_delta),
        "encoded_bytes": sum(sum(d.encoded_bytes) for d in with_delta),
        "holders": holders,
    }


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
