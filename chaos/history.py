"""The operation history of a chaos run: every operation's invoke and completion, per client.

Each worker process appends JSON lines to its own file and flushes after every line, so a
SIGKILLed worker leaves every record it wrote up to the kill. An operation is written twice:
an `invoke` record before the call and a completion record after it. A completion is `ok`,
`fail` (it definitely did not happen: an error raised before anything was written, or any
failed read) or `info` (the outcome is unknown: a timeout or lost connection during a write).
An invoke with no completion (the process was killed) is also `info` — like Jepsen's
histories, which etcd's robustness tests follow.

Times are `time.monotonic()` seconds, which on Linux is one clock for every process.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tensorhub.errors import (
    AlreadyExists,
    IntegrityError,
    InvalidArgument,
    PermissionDenied,
    QuotaExceeded,
    RetentionViolation,
    StaleVersion,
    VersionNotFound,
)

# Errors that prove a write did not happen (docs/design.md, "Errors and outcomes"); any other
# error of a
# write leaves its outcome unknown.
DEFINITE_WRITE_ERRORS: tuple[type[Exception], ...] = (
    StaleVersion,
    InvalidArgument,
    PermissionDenied,
    QuotaExceeded,
    AlreadyExists,
    RetentionViolation,
    VersionNotFound,
    IntegrityError,
)

OK, FAIL, INFO = "ok", "fail", "info"

# The model of the model-parallel workload (`chaos.shards`): its operations are checked by
# `chaos.checker_shards`, the whole-version model's by the rest of the checker.
MP_MODEL = "policy-mp"


@dataclass
class Op:
    """One operation of one client, invoke to completion (`complete` None: never completed)."""

    id: int
    client: str  # worker name and incarnation, e.g. "reader-0#2"
    f: str  # publish, latest, fetch, release, watch, probe; publish-shard, fetch-shard, ...
    invoke: float
    timeout: float
    args: dict[str, Any] = field(default_factory=dict)
    outcome: str = INFO
    complete: float | None = None
    value: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    @property
    def worker(self) -> str:
        return self.client.split("#", 1)[0]

    @property
    def end(self) -> float:
        """When the operation can last have taken effect (infinity if it never completed)."""
        return self.complete if self.complete is not None else float("inf")

    def brief(self, start: float = 0.0) -> str:
        """One line naming the operation, for violation reports."""
        done = f"{self.complete - start:.3f}" if self.complete is not None else "never"
        what = ", ".join(f"{k}={v}" for k, v in {**self.args, **self.value}.items())
        err = f" {self.error}" if self.error else ""
        return (
            f"[{self.client} op {self.id}] {self.f}({what}) {self.outcome}{err} "
            f"invoked {self.invoke - start:.3f}s, completed {done}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "client": self.client, "f": self.f, "invoke": self.invoke,
            "complete": self.complete, "timeout": self.timeout, "outcome": self.outcome,
            "args": self.args, "value": self.value, "error": self.error,
        }  # fmt: skip


class Recorder:
    """Writes one client's history (thread-safe; one line per record, flushed at once)."""

    def __init__(self, path: Path, client: str) -> None:
        self.client = client
        self._file: TextIO = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self._next = 0

    def _write(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._file.flush()

    def invoke(self, f: str, timeout: float, **args: Any) -> int:
        with self._lock:
            self._next += 1
            op_id = self._next
        self._write(
            {"type": "invoke", "id": op_id, "client": self.client, "f": f,
             "t": time.monotonic(), "timeout": timeout, "args": args}
        )  # fmt: skip
        return op_id

    def complete(self, op_id: int, outcome: str, error: str = "", **value: Any) -> None:
        self._write(
            {"type": outcome, "id": op_id, "client": self.client, "t": time.monotonic(),
             "value": value, "error": error}
        )  # fmt: skip

    def instant(self, f: str, **value: Any) -> None:
        """An observation with no duration (a watch event)."""
        op_id = self.invoke(f, 0.0)
        self.complete(op_id, OK, **value)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def error_name(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def write_outcome(exc: BaseException) -> str:
    """The outcome of a write that raised `exc`: `fail` only if it surely did not happen."""
    return FAIL if isinstance(exc, DEFINITE_WRITE_ERRORS) else INFO


def read_records(paths: Iterable[Path]) -> Iterator[dict[str, Any]]:
    """Every record of every file; a torn last line (the writer was killed) is skipped."""
    for path in paths:
        with path.open(encoding="utf-8") as fh:
            for line in fh:
                try:
                    yield json.loads(line)
                except ValueError:
                    continue


def load_ops(paths: Iterable[Path]) -> list[Op]:
    """Pair invoke and completion records into operations, ordered by invoke time."""
    ops: dict[tuple[str, int], Op] = {}
    for rec in read_records(paths):
        key = (rec["client"], rec["id"])
        if rec["type"] == "invoke":
            ops[key] = Op(rec["id"], rec["client"], rec["f"], rec["t"], rec["timeout"], rec["args"])
        elif key in ops:
            op = ops[key]
            op.outcome, op.complete = rec["type"], rec["t"]
            op.value, op.error = rec.get("value", {}), rec.get("error", "")
    return sorted(ops.values(), key=lambda o: (o.invoke, o.client, o.id))
