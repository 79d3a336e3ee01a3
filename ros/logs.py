"""Structured logs: one JSON object per line (`tensorhub --log-json ...`), for log pipelines."""

from __future__ import annotations

import json
import logging
import time
from typing import ClassVar


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "msg", ...}` plus the exception text and any `extra=` fields."""

    _STANDARD: ClassVar[frozenset[str]] = frozenset(vars(logging.makeLogRecord({})))

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in self._STANDARD and key not in entry:
                entry[key] = value if isinstance(value, (int, float, str, bool)) else repr(value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure(verbosity: int, as_json: bool) -> None:
    """Root logging: WARNING, INFO (-v) or DEBUG (-vv); JSON lines with `as_json`."""
    handler = logging.StreamHandler()
    if as_json:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel([logging.WARNING, logging.INFO, logging.DEBUG][min(verbosity, 2)])
