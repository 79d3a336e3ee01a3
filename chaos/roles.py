"""A chaos run's client process: `python -m chaos.roles SPEC_JSON` runs the role its spec
names (`chaos.worker` for the roles and the process's set-up, `chaos.intruder`,
`chaos.shards`, `chaos.layout_readers`) and leaves without the interpreter's finalization.

Apart from `chaos.worker` so that the roles built on it (`chaos.intruder`, `chaos.shards`)
do not make a circle of imports with the table that picks them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from chaos.history import error_name
from chaos.intruder import intruder
from chaos.layout_readers import layout_reader
from chaos.shards import rank, shard_reader
from chaos.worker import Worker, poller, publisher, reader, watcher
from tensorhub.errors import TensorHubError
from tensorhub.process_exit import exit_now


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    w = Worker(spec)
    roles: dict[str, Callable[[Worker], None]] = {
        "publisher": publisher, "reader": reader, "watcher": watcher, "poller": poller,
    }  # fmt: skip
    roles.update({"intruder": intruder, "rank": rank, "shard-reader": shard_reader})
    roles["layout-reader"] = layout_reader
    try:
        roles[spec["role"]](w)
    except TensorHubError as exc:  # e.g. the hub never came back before the end
        print(f"{w.name}: {error_name(exc)}", file=sys.stderr)
    finally:
        if w.hub is not None:
            w.hub.close()
        w.rec.close()
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
