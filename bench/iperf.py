"""iperf3 over loopback: the C reference of `tensorhub bench transport`.

iperf3 (Debian's `iperf3` package, installed by scripts/setup-system.sh) moves bytes between
a C sender and a C receiver with no Python in the loop, so it bounds the plain Python socket
from above. Asked for: `-Z -l 4M` (zero copy: the client sends with sendfile; 4 MiB writes
and reads, TensorHub's default chunk size). Two things found on this machine shape how it
runs:

- Debian 12's iperf3 (3.12) refuses writes over 1 MiB ("block size too large (maximum =
  1048576 bytes)"): the block is clamped to the maximum the binary names, and the flags
  actually used are reported.
- On loopback `-Z` is slower, not faster (2.2 GB/s against 4.6 GB/s with plain 1 MiB
  writes, one stream): the receiver copies either way, and sendfile adds page-cache work.
  So each run measures both, `-Z -l B` and `-l B`, and the reference is the better one: a
  reference that understates what C can do would flatter TensorHub.

`-J` makes iperf3 report as JSON; the bench reads the receiver's rate (`end.sum_received`).
Without iperf3 the reference is skipped and `note` says why: nothing raises.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
from types import TracebackType

from tensorhub.errors import InvalidArgument

MiB = 1 << 20
BLOCK = 4 * MiB  # asked for with -l; clamped to what the binary accepts
START_WAIT = 5.0  # how long a client retries while the server is still starting (s)
NOT_INSTALLED = "iperf3 not installed (apt-get install iperf3): the C reference is skipped"
_MAX_BLOCK = re.compile(r"block size too large \(maximum = (\d+) bytes\)")


def parse_rate(text: str) -> float:
    """Bytes/s the receiver saw, from an iperf3 `-J` report. `InvalidArgument`, with
    iperf3's own message, when `text` is not the report of a completed run: not JSON, an
    error report, or one without `end.sum_received.bits_per_second`."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"iperf3 printed no JSON report: {text[:200]!r}") from exc
    if not isinstance(data, dict):
        raise InvalidArgument(f"iperf3 report is not a JSON object: {text[:200]!r}")
    if data.get("error"):
        raise InvalidArgument(f"iperf3: {data['error']}")
    end = data.get("end")
    received = end.get("sum_received") if isinstance(end, dict) else None
    bits = received.get("bits_per_second") if isinstance(received, dict) else None
    if isinstance(bits, bool) or not isinstance(bits, int | float) or bits <= 0:
        raise InvalidArgument("iperf3 report has no end.sum_received.bits_per_second")
    return float(bits) / 8


def max_block(output: str) -> int | None:
    """The largest `-l` the binary accepts, when its output says the one asked was too large."""
    found = _MAX_BLOCK.search(output)
    return int(found.group(1)) if found else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Iperf3:
    """An iperf3 server on 127.0.0.1 for the life of the `with` block, measured by client
    runs of `seconds` each. `rates` keeps every run: (flags, connections) -> bytes/s. When
    iperf3 is missing or a run fails, `measure` answers None and `note` says why."""

    def __init__(self, seconds: int = 2) -> None:
        self.seconds = max(1, seconds)
        self.binary = shutil.which("iperf3")
        self.note = "" if self.binary else NOT_INSTALLED
        self.block = BLOCK
        self.rates: dict[tuple[str, int], list[float]] = {}
        self._server: subprocess.Popen[bytes] | None = None
        self._port = 0

    def __enter__(self) -> Iperf3:
        if self.binary:
            self._port = _free_port()
            self._server = subprocess.Popen(
                [self.binary, "-s", "-B", "127.0.0.1", "-p", str(self._port)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.terminate()
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()

    def flags(self, zero_copy: bool) -> str:
        """`-Z -l 1M` or `-l 1M`: the flags of one variant, with the block in use."""
        size = f"{self.block // MiB}M" if self.block % MiB == 0 else str(self.block)
        return f"{'-Z ' if zero_copy else ''}-l {size}"

    def command(self, parallel: int, zero_copy: bool) -> list[str]:
        """The client command line for `parallel` connections (`-P`)."""
        return [
            self.binary or "iperf3", "-c", "127.0.0.1", "-p", str(self._port),
            *self.flags(zero_copy).split(), "-P", str(parallel), "-t", str(self.seconds), "-J",
        ]  # fmt: skip

    def measure(self, parallel: int) -> float | None:
        """Bytes/s over `parallel` connections, the better of `-Z` and plain writes; None
        when skipped or failed (see `note`)."""
        rates = [self._run(parallel, zero_copy) for zero_copy in (True, False)]
        found = [r for r in rates if r is not None]
        return max(found) if found else None

    def best(self, parallel: int) -> tuple[float, str] | None:
        """The best rate of every run at `parallel` connections, and the flags that got it."""
        runs = [(max(v), flags) for (flags, n), v in self.rates.items() if n == parallel and v]
        return max(runs) if runs else None

    def _run(self, parallel: int, zero_copy: bool) -> float | None:
        if self._server is None:
            return None
        give_up = time.monotonic() + START_WAIT
        while True:
            try:
                done = subprocess.run(
                    self.command(parallel, zero_copy), capture_output=True, text=True,
                    check=False, timeout=self.seconds + 30,
                )  # fmt: skip
            except subprocess.TimeoutExpired as exc:
                self.note = f"iperf3 -P {parallel} did not finish ({exc})"
                return None
            limit = max_block(done.stdout + done.stderr)
            if limit is not None and limit < self.block:
                self.block = limit  # this iperf3 caps -l: use its largest
                continue
            try:
                rate = parse_rate(done.stdout)
            except InvalidArgument as exc:
                starting = "connect" in str(exc) or "busy" in str(exc)
                if starting and time.monotonic() < give_up:  # the server is not listening yet
                    time.sleep(0.1)
                    continue
                self.note = f"iperf3 {self.flags(zero_copy)} -P {parallel} failed ({exc})"
                return None
            self.rates.setdefault((self.flags(zero_copy), parallel), []).append(rate)
            return rate
