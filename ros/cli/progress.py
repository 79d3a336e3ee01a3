"""Progress of long CLI work: a tqdm bar on a terminal, plain lines when not.

`fetch`, `publish --until-replicated`, `bench` and `chaos run` take minutes. On a terminal
they show tqdm's bar (done, total, rate, time left); in a log or a pipe (CI, `| tee`) a bar
redrawn with carriage returns is noise, so there the same figures are printed as plain lines,
at most one per `every` seconds, plus the last one. Both are drawn by tqdm
(`tqdm.format_meter`): no renderer of our own. Everything goes to stderr, so stdout stays the
command's result (tables, `--json`).

A `Bar` is thread-safe: a fetch reports from the threads that receive its chunks.
`Ticker` advances a bar with the clock, for work whose only measure is its duration
(`chaos run --duration`).
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import IO, Any

from tqdm import tqdm

PLAIN_EVERY = 5.0  # seconds between plain lines (not a terminal)


def is_terminal(stream: IO[str]) -> bool:
    """Whether `stream` is an interactive terminal (a bar), else plain lines."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


class Bar:
    """Progress of `total` units (bytes with `unit="B"`) described by `desc`.

    `advance(n)` adds n; `reach(n)` moves to n if that is further (for reports of a running
    total, which may arrive out of order from several threads). `write(text)` prints a line
    without breaking the bar. `close()` prints the final state (also as a plain line).
    """

    def __init__(
        self,
        total: float,
        desc: str,
        *,
        unit: str = "B",
        stream: IO[str] | None = None,
        terminal: bool | None = None,
        every: float = PLAIN_EVERY,
    ) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._terminal = is_terminal(self._stream) if terminal is None else terminal
        self._lock = threading.Lock()
        self._total = float(total)
        self._desc = desc
        self._unit = unit
        self._scale = unit == "B"  # bytes: KB/MB/GB, in powers of 1024
        self._every = every
        self._start = time.monotonic()
        self._last_line = self._start
        self._n = 0.0
        self._printed = -1.0  # the count of the last plain line
        self._closed = False
        self._tqdm: tqdm[Any] | None = None
        if self._terminal:
            self._tqdm = tqdm(
                total=total, desc=desc, unit=unit, unit_scale=self._scale,
                unit_divisor=1024 if self._scale else 1000, file=self._stream,
                dynamic_ncols=True, leave=True,
            )  # fmt: skip
        else:  # a log shows when the work began, and what it is
            self._printed = 0.0
            print(self.line(), file=self._stream, flush=True)

    @property
    def n(self) -> float:
        return self._n

    def advance(self, n: float) -> None:
        with self._lock:
            self._move(self._n + n)

    def reach(self, n: float) -> None:
        """Move to `n` if that is further; else only let the time shown move on (a wait that
        makes no progress still shows a line every `every` seconds in a log)."""
        with self._lock:
            if n > self._n:
                self._move(n)
            else:
                self._heartbeat()

    def write(self, text: str) -> None:
        """A line of its own above the bar (or among the plain lines)."""
        with self._lock:
            if self._tqdm is not None:
                self._tqdm.write(text, file=self._stream)
            else:
                print(text, file=self._stream, flush=True)

    def line(self) -> str:
        """The current state as one line, as tqdm formats it (rate, time left)."""
        return str(
            tqdm.format_meter(
                _whole(self._n), _whole(self._total), time.monotonic() - self._start,
                prefix=self._desc, unit=self._unit, unit_scale=self._scale,
                unit_divisor=1024 if self._scale else 1000,
                bar_format="{desc}: {percentage:3.0f}%{r_bar}" if self._total else None,
            )
        )  # fmt: skip

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._tqdm is not None:
                self._tqdm.close()
            elif self._printed != self._n:
                print(self.line(), file=self._stream, flush=True)

    def _heartbeat(self) -> None:
        if self._closed:
            return
        if self._tqdm is not None:
            self._tqdm.update(0)  # redraws (elapsed time) at most every tqdm's mininterval
            return
        now = time.monotonic()
        if now - self._last_line >= self._every:
            self._last_line, self._printed = now, self._n
            print(self.line(), file=self._stream, flush=True)

    def _move(self, n: float) -> None:
        if self._closed:
            return
        step, self._n = n - self._n, n
        if self._tqdm is not None:
            self._tqdm.update(step)
            return
        now = time.monotonic()
        if now - self._last_line >= self._every:
            self._last_line, self._printed = now, self._n
            print(self.line(), file=self._stream, flush=True)

    def __enter__(self) -> Bar:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _whole(x: float) -> float:
    """`x`, as an int when it is one (tqdm prints 1/1, not 1/1.0)."""
    return int(x) if float(x).is_integer() else x


class Ticker:
    """Advance `bar` (whose unit is seconds) with the clock, every `period` seconds, in whole
    seconds up to its total, from a daemon thread; `stop()` ends it (bounded: one period)."""

    def __init__(self, bar: Bar, total_seconds: float, period: float = 1.0) -> None:
        self._bar = bar
        self._total = total_seconds
        self._period = period
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="progress-ticker", daemon=True)

    def start(self) -> Ticker:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            elapsed = time.monotonic() - self._start
            self._bar.reach(min(self._total, float(int(elapsed))))
            if elapsed >= self._total:
                return  # the time is up: what follows has no measure of its own

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._period + 1.0)
