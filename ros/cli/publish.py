"""`tensorhub publish MODEL@V PATH`: publish a checkpoint from disk and serve it.

The checkpoint is opened memory-mapped (`ros.cli.checkpoint`), published with the SDK, and
served from the files' pages by this process until Ctrl-C, or until `--until-replicated N`
other holders have it whole (`ros.cli.serving`). Everything about PATH is checked before
the hub is contacted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from ros.cli.carry import LEFT_KEY, encode, publish_carrying
from ros.cli.checkpoint import MAX_CARRIED_FILE_BYTES, Checkpoint, open_checkpoint
from ros.cli.common import print_json
from ros.cli.connect import add_client_flags, check_credentials, connect
from ros.cli.progress import Bar
from ros.cli.rss import memory, mib
from ros.cli.serving import (
    Interrupts,
    Readers,
    drain,
    say_stderr,
    stop,
    wait_interrupted,
    wait_replicated,
)
from ros.client.manifest import Placements
from ros.manifest_check import MAX_METADATA_BYTES
from tensorhub.errors import InvalidArgument
from tensorhub.names import validate_name, validate_version
from tensorhub.view_rules import check_views, view_model
from transport.boxes import Box

DESCRIPTION = """\
Publish MODEL@V from a checkpoint on disk, and serve it from this process until Ctrl-C
(or until --until-replicated N readers hold it).

PATH is one of:
  - a safetensors file;
  - a directory written by save_pretrained: model.safetensors.index.json and its shards,
    or a single model.safetensors;
  - a torch state-dict file (torch.save(model.state_dict(), PATH)), read with
    torch.load(weights_only=True, mmap=True): no pickled code runs.
Tensors are memory-mapped, never copied: the files' pages are what readers are served
from. From a directory, config.json, generation_config.json and the tokenizer files travel
in the manifest's metadata (at most 64 KiB in all, compressed; what does not fit, or is
over 1 MiB and so is not even read, is named and left behind), so that `tensorhub fetch`
writes a directory from_pretrained can load. Every file read from a directory must lie in
it: a link out of it is refused, except a Hugging Face cache snapshot's links into its
repository's blobs/.

Ctrl-C (or SIGTERM) stops serving: the first waits for the readers fetching from this
process at that moment to finish, and says so; a second stops at once. --until-replicated N
stops once N other holders have the version whole: readers that fetch with the SDK (they
hold what they fetched) and `tensorhub fetch --serve`; a plain `tensorhub fetch` writes the
version to disk without holding it, in bounded memory, and is not counted. The hub, tenant and
token come from --hub/--tenant/--token or TENSORHUB_HUB, TENSORHUB_TENANT, TENSORHUB_TOKEN.

Model-parallel: with --shard RANK/RANKS, PATH holds rank RANK's tensors only, and every
rank runs its own `tensorhub publish MODEL@V PATH_OF_RANK --shard RANK/RANKS`; the version
becomes visible when the last rank has published. Where a rank holds a block of a larger
tensor, --placements FILE.json says which block: {"NAME": {"global_shape": [...],
"offsets": [...]}, ...}; a tensor without a placement is whole (each rank's own, or the
same on every rank). `tensorhub fetch` assembles the blocks into whole tensors.

Views: --view FMT (repeatable: fp8-block128, mxfp8; docs/views.md) publishes, with the
version and visible with it, its quantized view as version V of MODEL.FMT, quantized here
and served by this process with the version. Readers fetch it with
`tensorhub fetch MODEL@V --view FMT`. A view of a model-parallel version needs its ranks'
process group (the scales of a block split across ranks are agreed over it): publish those
with the SDK, `publish(..., shard=..., views=...)`; --view with --shard is refused.
"""


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("target", metavar="MODEL@V", help="the model and the version to publish")
    parser.add_argument("path", metavar="PATH", type=Path, help="checkpoint file or directory")
    parser.add_argument(
        "--until-replicated",
        type=int,
        metavar="N",
        help="stop once N other holders have the version whole (progress shown), instead of "
        "serving until Ctrl-C: SDK readers (hub.fetch) and `tensorhub fetch --serve` hold it; "
        "a plain `tensorhub fetch` reads without holding, and does not count",
    )
    parser.add_argument(
        "--wait-timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="with --until-replicated: DeadlineExceeded after this long (default %(default)s)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="the longest the first Ctrl-C waits for readers in flight (default %(default)s)",
    )
    parser.add_argument(
        "--shard",
        metavar="RANK/RANKS",
        help="publish rank RANK's shard of a model-parallel version of RANKS shards: PATH "
        "holds that rank's tensors",
    )
    parser.add_argument(
        "--placements",
        type=Path,
        metavar="FILE.json",
        help="with --shard: the block of each global tensor this rank holds "
        '({"NAME": {"global_shape": [..], "offsets": [..]}}); unnamed tensors are whole',
    )
    parser.add_argument(
        "--view",
        dest="views",
        action="append",
        default=[],
        metavar="FMT",
        help="also publish this quantized view of the version, visible with it, as version V "
        "of MODEL.FMT (fp8-block128, mxfp8; docs/views.md); repeat for both",
    )
    parser.add_argument(
        "--no-files",
        action="store_true",
        help="carry no config or tokenizer files in the manifest",
    )
    add_client_flags(parser)


def parse_version(target: str) -> tuple[str, int]:
    model, sep, version = target.partition("@")
    validate_name(model, "model")
    if not sep or not version.isdigit():
        raise InvalidArgument(f"{target!r}: publish needs MODEL@V with V a positive integer")
    return model, validate_version(int(version))


def parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    rank, sep, ranks = text.partition("/")
    if not (sep and rank.isdigit() and ranks.isdigit() and 0 <= int(rank) < int(ranks)):
        raise InvalidArgument(f"--shard {text!r}: expected RANK/RANKS with 0 <= RANK < RANKS")
    return int(rank), int(ranks)


def load_placements(path: Path | None, ckpt: Checkpoint) -> Placements | None:
    """The placements file, checked against the checkpoint's tensors (before the hub)."""
    if path is None:
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"--placements {path}: not a readable JSON file: {exc}") from None
    if not isinstance(raw, dict):
        raise InvalidArgument(f"--placements {path}: expected an object of tensor names")
    out: dict[str, tuple[list[int], list[int]]] = {}
    for name, entry in raw.items():
        tensor = ckpt.tensors.get(name)
        if tensor is None:
            raise InvalidArgument(f"--placements {path}: {name!r} is not a tensor of {ckpt.path}")
        try:
            glob = [int(d) for d in entry["global_shape"]]
            offsets = [int(o) for o in entry["offsets"]]
            fits = Box(tuple(offsets), tuple(tensor.shape)).within(tuple(glob))
        except (KeyError, TypeError, ValueError, InvalidArgument) as exc:
            raise InvalidArgument(
                f"--placements {path}: {name!r} needs global_shape and offsets ({exc})"
            ) from None
        if not fits:
            raise InvalidArgument(
                f"--placements {path}: {name!r} of shape {list(tensor.shape)} at {offsets} "
                f"does not fit in {glob}"
            )
        out[name] = (glob, offsets)
    return out


def run(args: argparse.Namespace) -> int:
    model, version = parse_version(args.target)
    shard = parse_shard(args.shard)
    if args.placements is not None and shard is None:
        raise InvalidArgument("--placements describe a model-parallel shard: pass --shard too")
    if args.until_replicated is not None and args.until_replicated < 1:
        raise InvalidArgument("--until-replicated needs N >= 1")
    views = check_views(model, args.views) if args.views else []
    if views and shard is not None:
        raise InvalidArgument(
            "--view with --shard: a view of a model-parallel version agrees its block scales "
            "over the ranks' process group; publish it with the SDK (publish(..., views=...))"
        )
    check_credentials(args)
    started = time.monotonic()
    ckpt = open_checkpoint(args.path, carry=not args.no_files)
    placements = load_placements(args.placements, ckpt)
    metadata, carried = encode(ckpt.carried, ckpt.too_big)
    with connect(args) as hub:
        pub = publish_carrying(
            hub,
            model,
            version,
            ckpt.tensors,
            metadata,
            shard=shard,
            placements=placements,
            views=views,
        )
        published = time.monotonic() - started
        what = f"{model}@{version}" + ("" if shard is None else f" shard {shard[0]}/{shard[1]}")
        summary: dict[str, Any] = {
            "model": model,
            "version": version,
            "shard": None if shard is None else list(shard),
            "views": [view_model(model, fmt) for fmt in views],
            "revision": pub.revision,
            "visible": pub.visible,
            "tensors": len(ckpt.tensors),
            "bytes": ckpt.nbytes,
            "kind": ckpt.kind,
            "files": [str(f) for f in ckpt.files],
            "carried": sorted(carried.files),
            "left_behind": carried.left,
            "publish_seconds": round(published, 3),
        }
        out = sys.stderr if args.json else sys.stdout
        _say_published(what, ckpt, summary, hub.holder_name, out)
        with Interrupts() as interrupts:
            index = None if shard is None else shard[0]
            readers = Readers(hub, model, version, index, since=pub.revision)
            try:
                summary["stopped_by"] = _serve(args, readers, interrupts, what)
                gentle = interrupts.count < 2 and drain(
                    readers, interrupts, say_stderr, args.drain_timeout
                )
                summary["readers_complete"] = len(readers.complete)
                stop(hub, pub, readers, gentle, say_stderr)
            finally:
                readers.close()
    mem = memory()
    summary["peak_rss_bytes"] = mem.peak
    summary["seconds"] = round(time.monotonic() - started, 3)
    if args.json:
        print_json(summary)
    return 0


def _serve(args: argparse.Namespace, readers: Readers, interrupts: Interrupts, what: str) -> str:
    """Serve until the stop condition; returns what stopped it."""
    if args.until_replicated is None:
        say_stderr(
            f"serving {what}; Ctrl-C to stop (the first waits for readers in flight, the "
            "second stops at once)"
        )
        wait_interrupted(readers, interrupts)
        return "interrupt"
    n = args.until_replicated
    with Bar(n, f"{what}: readers holding it", unit="reader") as bar:
        reached = wait_replicated(readers, n, interrupts, args.wait_timeout, bar)
    if reached:
        say_stderr(f"{what}: {len(readers.complete)} reader(s) hold it whole")
        return "replicated"
    return "interrupt"


def _say_published(
    what: str, ckpt: Checkpoint, summary: dict[str, Any], holder: str, out: TextIO
) -> None:
    mem = memory()
    files = len(ckpt.files)
    visible = "" if summary["visible"] else " (visible once every shard is published)"
    print(
        f"published {what}{visible}: {summary['tensors']} tensors, {mib(ckpt.nbytes)} from "
        f"{files} {ckpt.kind} file{'s' if files != 1 else ''} (memory-mapped), in "
        f"{summary['publish_seconds']:.2f}s; revision {summary['revision']}; holder {holder}",
        file=out,
    )
    print(
        f"  memory: {mib(mem.anon)} anonymous, {mib(mem.file)} file-backed (libraries, the "
        f"mapped checkpoint; peak RSS {mib(mem.peak)})",
        file=out,
    )
    for name in summary["views"]:
        print(f"  view: {name}@{summary['version']}, visible with it", file=out)
    if summary["carried"]:
        print(f"  carried in the manifest: {', '.join(summary['carried'])}", file=out)
    elif ckpt.kind != "save_pretrained":
        print(
            "  carried: nothing (PATH is a file; pass its directory to carry config.json)",
            file=out,
        )
    for name, size in sorted(summary["left_behind"].items()):
        why = (
            f"over the {MAX_CARRIED_FILE_BYTES} bytes a carried file may be: not read"
            if name in ckpt.too_big
            else f"the manifest's metadata holds at most {MAX_METADATA_BYTES} bytes"
        )
        print(f"  left behind: {name} ({size} bytes; {why}; `{LEFT_KEY}` names it)", file=out)
    out.flush()
