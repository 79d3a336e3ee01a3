"""`tensorhub fetch MODEL@V -o DIR`: a version written to disk as `save_pretrained` writes it.

The directory gets safetensors files (sharded, with `model.safetensors.index.json`), the
config and tokenizer files the version carries (`ros.cli.carry`), and `tensorhub.json`
(version, revisions, checksums), so `from_pretrained(DIR)` works with nothing copied by
hand. The steps: check the output (`ros.cli.outdir`), connect, inspect the version, plan
the files (`ros.cli.outplan`), check the free space, fill them (`ros.cli.fetchwrite`),
write the rest, rename the directory into place, and with `--serve`, serve until Ctrl-C.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import re
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from ros.cli.carry import Carried, decode
from ros.cli.common import print_json
from ros.cli.connect import add_client_flags, check_credentials, connect
from ros.cli.fetchwrite import Mapped, Until, Written, mapped_fill, pinned, stream_fill, write_file
from ros.cli.outdir import RECORD, Output
from ros.cli.outplan import INDEX, ChunkCost, OutFile, batches, global_tensors, pieces, plan_files
from ros.cli.progress import Bar
from ros.cli.query import parse_target
from ros.cli.rss import Memory, memory, mib
from ros.cli.serving import Interrupts, Readers, drain, say_stderr, stop, wait_interrupted
from ros.cli.viewdir import view_config
from ros.client.hub import Hub
from ros.manifest_check import check_manifest
from ros.proto.tensorhub.v1 import hub_pb2 as pb
from tensorhub.errors import InvalidArgument, InvalidManifest
from tensorhub.view_rules import view_model

DESCRIPTION = """\
Fetch MODEL@V (or MODEL@latest) into DIR as save_pretrained writes a model: safetensors
files of at most --max-shard-size with model.safetensors.index.json (one model.safetensors
when it fits), the config and tokenizer files the version carries, and tensorhub.json (the
version, its revision, and each file's SHA-256). from_pretrained(DIR) then loads it.

A model-parallel version is written whole: its shards' blocks are assembled into full
tensors. The bytes are read in batches of bounded size, checked against the publisher's
checksums, and written as they come: the memory this process uses stays within its
baseline plus one shard file plus 64 MiB, whatever the model's size (reported at the end).

DIR appears only when complete: the files are written to a hidden directory beside it and
renamed. A failed, interrupted or killed fetch leaves no DIR (a killed one's hidden
directory is removed by the next fetch into DIR). DIR that exists is not replaced unless
--force, and then only if an earlier fetch wrote it. A full disk is DiskFull.

With --serve, this process holds the version after writing it and serves it to other
readers from DIR's files until Ctrl-C (the first waits for readers in flight, the second
stops at once); DIR must not be changed while it serves. The hub, tenant and token come
from --hub/--tenant/--token or TENSORHUB_HUB, TENSORHUB_TENANT, TENSORHUB_TOKEN.
"""

MIN_BATCH = 8 << 20  # the smallest batch budget, and
MAX_BATCH = 256 << 20  # the largest: one fetch_slices call per batch
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "target", metavar="MODEL@V", help="MODEL@V, MODEL@latest, or MODEL (the latest)"
    )
    parser.add_argument(
        "-o", "--output", type=Path, required=True, metavar="DIR", help="directory to create"
    )
    parser.add_argument("--force", action="store_true", help="replace DIR from an earlier fetch")
    parser.add_argument(
        "--serve", action="store_true", help="then hold the version and serve it until Ctrl-C"
    )
    parser.add_argument(
        "--view",
        metavar="FORMAT",
        help="fetch this view of the version (fp8-block128, mxfp8: docs/views.md); config.json "
        "gets its quantization_config",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest safetensors file, as save_pretrained's max_shard_size: 5GB, 500MB, "
        "2GiB, or bytes (default %(default)s)",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="DeadlineExceeded if the fetch takes longer (default %(default)s)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="with --serve: the longest the first Ctrl-C waits for readers in flight",
    )
    add_client_flags(parser)


def parse_size(text: str) -> int:
    """`5GB` (10^9), `2GiB` (2^30), `500MB`, `20KB` or a number of bytes."""
    match = _SIZE.match(text)
    if match is None:
        raise InvalidArgument(f"--max-shard-size {text!r}: expected e.g. 5GB, 500MB, 2GiB")
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if size <= 0:
        raise InvalidArgument(f"--max-shard-size {text!r} must be positive")
    return size


def batch_budget(largest_file: int) -> int:
    """Chunk bytes one batch may stage: a quarter of the largest output file, within
    [MIN_BATCH, MAX_BATCH]. A fetch holds at most three batches (one written, one fetched,
    and that one's staged chunks), and some more besides (the interpreter's and the
    transport's buffers, the allocator's slack: up to 30 MiB measured): three budgets and
    that stay within the file plus the 64 MiB the bound allows (budgets of a third of the
    file, at least 16 MiB, once went 2 MiB over it, for files of 12 MiB)."""
    return max(MIN_BATCH, min(MAX_BATCH, largest_file // 4))


def _sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up the partial output like Ctrl-C


def run(args: argparse.Namespace) -> int:
    model, number = parse_target(args.target)
    if args.view is not None:
        model = view_model(model, args.view)  # MODEL@V's view: version V of MODEL.FORMAT
    max_shard = parse_size(args.max_shard_size)
    if args.deadline <= 0:
        raise InvalidArgument("--deadline must be positive")
    check_credentials(args)
    started = time.monotonic()
    output = Output(args.output, force=args.force)
    output.prepare()  # before the hub: an unwritable or existing DIR fails here
    old_term = signal.signal(signal.SIGTERM, _sigterm)
    try:
        return _run(args, output, model, number, max_shard, started)
    finally:
        signal.signal(signal.SIGTERM, old_term)


def _run(
    args: argparse.Namespace,
    output: Output,
    model: str,
    number: int,
    max_shard: int,
    started: float,
) -> int:
    mapped: Mapped | None = None
    with output, connect(args) as hub:
        until = Until.after(args.deadline, f"fetch {args.target}")
        baseline = memory()
        info = hub.inspect(model, number, timeout=min(args.timeout, until.left()))
        version = int(info.version)
        parts = list(info.shards) or [info.manifest]
        for index, part in enumerate(parts):  # Inspect's answer is not checked by the SDK
            shard = f"shard {index} of " if info.shards else ""
            check_manifest(part, f"manifest of {shard}{model}@{version}")
        if args.serve and info.shards:
            raise InvalidArgument(
                f"{model}@{version} is model-parallel: it is written whole, and a reader of "
                "whole tensors is no holder of any shard, so it cannot --serve it (serve "
                "shards with the SDK's fetch(shard=i))"
            )
        files = plan_files(global_tensors(parts), max_shard)
        carried = view_config(_carried(parts), parts[0].metadata)
        _check_own(files, carried, f"{model}@{version}")
        total = sum(s.nbytes for f in files for s in f.specs)
        output.check_space(sum(f.nbytes for f in files) + sum(map(len, carried.files.values())))
        with Bar(total, f"fetch {model}@{version}") as bar:
            if args.serve:
                mapped, written = mapped_fill(hub, model, version, output.path, files, until, bar)
            else:
                written = _stream(hub, model, version, output.path, files, parts, until, bar)
        record = _finish(output.path, model, files, carried, written, info, args.target)
        output.commit()
        seconds = time.monotonic() - started
        report = _report(record, written, files, baseline, memory(), seconds, output.target)
        report["serving"] = mapped is not None
        if args.json:
            print_json(report)
        else:
            _print(report, carried, sys.stdout)
        if mapped is not None:
            _serve(hub, mapped, model, version, args.drain_timeout)
    return 0


def _stream(
    hub: Hub,
    model: str,
    version: int,
    directory: Path,
    files: list[OutFile],
    parts: list[pb.Manifest],
    until: Until,
    bar: Bar,
) -> Written:
    budget = batch_budget(max(f.nbytes for f in files))
    plan = list(batches(list(pieces(files, budget // 2)), ChunkCost(parts), budget))
    with pinned(hub, model, version, min(hub.timeout, until.left())):
        return stream_fill(hub, model, version, directory, files, plan, until, bar)


def _carried(parts: Sequence[pb.Manifest]) -> Carried:
    """The files the version carries (every shard's, the first shard's first)."""
    merged = Carried()
    for manifest in parts:
        found = decode(manifest.metadata)
        for name, data in found.files.items():
            merged.files.setdefault(name, data)
        for name, size in found.left.items():
            merged.left.setdefault(name, size)
    for name in merged.files:
        merged.left.pop(name, None)
    return merged


def _check_own(files: Sequence[OutFile], carried: Carried, what: str) -> None:
    """`InvalidManifest` before any byte is fetched if a carried file has the name of one
    the fetch writes itself (a weights file, the index, `tensorhub.json`). `decode` takes
    only allow-listed names, none of which is one of those: this holds it where it matters."""
    own = {f.name for f in files} | {INDEX, RECORD}
    if clash := sorted(own & carried.files.keys()):
        raise InvalidManifest(f"{what} carries {clash}: files a fetch writes itself")


def _finish(
    directory: Path,
    model: str,
    files: list[OutFile],
    carried: Carried,
    written: Written,
    info: pb.InspectResponse,
    asked: str,
) -> dict[str, Any]:
    """Write the index (several files), the carried files and `tensorhub.json`, last."""
    listed = {name: {"bytes": written.sizes[name], "sha256": written.sha256[name]}
              for name in written.sha256}  # fmt: skip
    extra: dict[str, bytes] = dict(carried.files)
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(s.nbytes for f in files for s in f.specs)},
            "weight_map": {s.name: f.name for f in files for s in sorted(f.specs, key=_name)},
        }
        extra[INDEX] = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
    for name, data in extra.items():
        write_file(directory / name, data)
        listed[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    parts = list(info.shards) or [info.manifest]
    record: dict[str, Any] = {
        "model": model,
        "version": int(info.version),
        "asked": asked,
        "published_revision": int(info.published_revision),
        "read_revision": int(info.revision),
        "fetched_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "shards": len(info.shards),
        "tensors": sum(len(f.specs) for f in files),
        "bytes": sum(s.nbytes for f in files for s in f.specs),
        "files": dict(sorted(listed.items())),
        "carried": sorted(carried.files),
        "left_behind": carried.left,
        "manifests": [
            {
                "shard": i if info.shards else None,
                "checksum": m.checksum or "xxh3-64",
                "chunk_size": int(m.chunk_size),
                "chunks": len(m.chunk_xxh3),
                "chunk_checksums_sha256": hashlib.sha256(
                    b"".join(int(c).to_bytes(8, "little") for c in m.chunk_xxh3)
                ).hexdigest(),
            }
            for i, m in enumerate(parts)
        ],
    }
    write_file(directory / RECORD, (json.dumps(record, indent=2) + "\n").encode())
    return record


def _name(spec: Any) -> str:
    return str(spec.name)


def _report(
    record: dict[str, Any],
    written: Written,
    files: list[OutFile],
    baseline: Memory,
    after: Memory,
    seconds: float,
    target: Path,
) -> dict[str, Any]:
    largest = max(f.nbytes for f in files)
    return {
        **record,
        "directory": str(target),
        "seconds": round(seconds, 3),
        "bytes_fetched": written.fetched,
        "batches": written.batches,
        "memory": {
            "baseline_rss": baseline.rss,
            "peak_rss": after.peak,
            "over_baseline": after.peak - baseline.rss,
            "bound": largest + (64 << 20),
            "largest_file": largest,
        },
    }


def _print(report: dict[str, Any], carried: Carried, out: TextIO) -> None:
    n = len([f for f in report["files"] if f.endswith(".safetensors")])
    rate = report["bytes"] / max(report["seconds"], 1e-9)
    print(
        f"fetched {report['model']}@{report['version']} (published at revision "
        f"{report['published_revision']}) into {report['directory']} in "
        f"{report['seconds']:.2f}s: {mib(report['bytes'])} in {n} safetensors "
        f"file{'s' if n != 1 else ''} ({mib(int(rate))}/s)",
        file=out,
    )
    if report["shards"]:
        print(f"  assembled whole from {report['shards']} shards", file=out)
    if carried.files:
        print(f"  carried files: {', '.join(sorted(carried.files))}", file=out)
    else:
        print("  carried files: none (from_pretrained needs a config.json)", file=out)
    for name, size in sorted(carried.left.items()):
        print(f"  not carried by the publisher: {name} ({size} bytes)", file=out)
    m = report["memory"]
    if report["serving"]:
        print(
            f"  peak RSS {mib(m['peak_rss'])}: {mib(m['over_baseline'])} over the baseline "
            "(held to serve it: the files' pages are mapped)",
            file=out,
        )
    else:
        print(
            f"  peak RSS {mib(m['peak_rss'])}: {mib(m['over_baseline'])} over the baseline "
            f"(bound: the largest file {mib(m['largest_file'])} + 64 MiB)",
            file=out,
        )
    out.flush()


def _serve(hub: Hub, mapped: Mapped, model: str, version: int, drain_timeout: float) -> None:
    with Interrupts() as interrupts:
        readers = Readers(hub, model, version, None)
        try:
            say_stderr(
                f"serving {model}@{version} from its files; Ctrl-C to stop (the first waits "
                "for readers in flight, the second stops at once)"
            )
            wait_interrupted(readers, interrupts)
            gentle = interrupts.count < 2 and drain(readers, interrupts, say_stderr, drain_timeout)
            stop(hub, mapped.held, readers, gentle, say_stderr)
        finally:
            readers.close()
            mapped.close()
