"""`tensorhub`: the command line (human output by default, `--json` for scripts).

Each command lives in its own module; this one only builds the parser and dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ros.logs import configure as configure_logging
from tensorhub.errors import TensorHubError

# command -> (module, one-line help). Each module has `add_arguments(parser)` and `run(args)`.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": (
        "ros.cli.serve",
        "run a hub replica (starts an embedded etcd when --etcd is not given)",
    ),
    "tenant": ("ros.cli.admin", "tenant administration: `tenant create NAME`"),
    "ls": ("ros.cli.query", "list the tenant's models and their versions"),
    "inspect": ("ros.cli.query", "show one version: MODEL@V (or MODEL for the latest)"),
    "holders": ("ros.cli.query", "list who holds MODEL@V, where, and in which state"),
    "delete": ("ros.cli.models", "delete MODEL and every version of it (a tenant's own, or admin)"),
    "publish": (
        "ros.cli.publish",
        "publish MODEL@V from a checkpoint on disk (safetensors, save_pretrained dir, torch "
        "state dict) and serve it",
    ),
    "fetch": (
        "ros.cli.fetch",
        "fetch MODEL@V into a directory from_pretrained loads (sharded safetensors + index)",
    ),
    "demo": ("ros.demo.cli", "a whole RL weight-update loop on this machine"),
    "bench": ("bench.cli", "benchmarks against baselines: `bench NAME|all`"),
    "chaos": ("chaos.cli", "fault-injection runs with an invariant checker: `chaos run`"),
}


def build_parser(wanted: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; only `wanted`'s module is imported (the others may pull in torch).

    With no command on the line (`tensorhub --help`), no command module is imported.
    """
    parser = argparse.ArgumentParser(
        prog="tensorhub",
        description="TensorHub: move RL weights from trainers to rollouts, served by holders.",
        epilog="Run `tensorhub COMMAND --help` for a command's options.",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)"
    )
    parser.add_argument("--log-json", action="store_true", help="log JSON lines (structured logs)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if name != wanted:
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # a command whose module is not installed here
            command.set_defaults(unavailable=f"{name} is unavailable: {exc}")
            continue
        module.add_arguments(command, name)
        command.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    wanted = next((w for w in words if w in COMMANDS), None)
    parser = build_parser(wanted)
    args = parser.parse_args(words)
    configure_logging(args.verbose, args.log_json)
    if getattr(args, "unavailable", None):
        print(args.unavailable, file=sys.stderr)
        return 2
    try:
        return int(args.run(args) or 0)
    except TensorHubError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
