"""Emulated hosts: one network namespace per host, a bridge per datacenter, a router
namespace between datacenters, every link shaped with `tc tbf` in both directions.

Layout (dc numbers d = 1, 2, …; `{n}` is 100 + this process's pid mod 100, so two runs
never share addresses):

    host ns  eth0 10.{n}.d.(i+1)/24 ──veth── bridge tb{tag}d{d} (root ns, 10.{n}.d.254)
    router   r{d} 10.{n}.d.253/24   ──veth── bridge tb{tag}d{d}

A host's upload is shaped on its own `eth0`, its download on the bridge-side end of its
veth; the inter-dc link is shaped on both router interfaces. Services the harness runs in
the root namespace (etcd stays on loopback; hub replicas) listen on the bridge addresses.
The kernel here has no netem, so there is no added latency: links differ in rate only.
Each tbf holds one FIFO of 20 ms; with `fair=True`, a host's upload queue is instead a
queue per address it sends to, served in turn (`_shape`), as a Linux host's own qdisc is.

Everything is named after the creating process (`thb-{pid}-…`), so a later run removes
what a crashed (SIGKILLed) run left behind; a normal exit, an exception, Ctrl-C or SIGTERM
remove everything at once.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType, TracebackType

from tensorhub.errors import TensorHubError

PREFIX = "thb-"
_NS_RE = re.compile(r"^thb-(\d+)-")


class NeedsRoot(TensorHubError):
    """The harness creates namespaces and qdiscs: it must run as root."""

    code = "FAILED_PRECONDITION"


class HarnessError(TensorHubError):
    """A namespace, link or qdisc could not be set up."""

    code = "INTERNAL"


def _sh(*argv: str, check: bool = True) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode != 0:
        raise HarnessError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _tag(pid: int) -> str:
    return f"{pid & 0xFFFF:04x}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces() -> list[str]:
    """Names of the namespaces this harness (any run) has created and not removed."""
    out = _sh("ip", "netns", "list", check=False)
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def remove_stale() -> list[str]:
    """Remove what runs that died without cleaning up left behind; returns the names."""
    removed = []
    for ns in namespaces():
        m = _NS_RE.match(ns)
        if m and not _alive(int(m.group(1))):
            _remove_run(int(m.group(1)))
            removed.append(ns)
    return removed


def _remove_run(pid: int) -> None:
    for ns in namespaces():
        if ns.startswith(f"{PREFIX}{pid}-"):
            for p in _sh("ip", "netns", "pids", ns, check=False).split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(p), signal.SIGKILL)
            _sh("ip", "netns", "del", ns, check=False)
    for line in _sh("ip", "-o", "link", "show", check=False).splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(f"tb{_tag(pid)}"):
            _sh("ip", "link", "del", name, check=False)


def _shape(ns: str | None, dev: str, mbit: float, fair_to: Sequence[str] = ()) -> None:
    """tbf on `dev`'s egress: `mbit` Mbit/s, a burst of 10 ms (>= 64 KiB), 20 ms of queue.

    With `fair_to` (the addresses this link sends to), the queue under the tbf is a fair
    one: a queue per address (the others share one), each of tbf's 20 ms, served in turn a
    frame at a time (htb classes of one priority, far above the link's rate, so only the
    tbf limits; deficit round robin). That is what the Linux default qdisc a host's NIC has
    (fq_codel, a queue per flow, sparse flows first) does to a host's own traffic: its
    ACKs and requests to one host do not wait behind the bytes it sends to another. The
    kernel here has no fq_codel or sfq, so the queues are per address, not per flow."""
    burst = max(int(mbit * 1e6 / 8 / 100), 64 * 1024)
    ex = ["ip", "netns", "exec", ns] if ns else []
    cmd = ["tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "tbf"]
    cmd += ["rate", f"{mbit}mbit", "burst", str(burst), "latency", "20ms"]
    _sh(*ex, *cmd)
    if not fair_to:
        return
    limit = int(mbit * 1e6 / 8 * 0.02) + burst  # what tbf's own queue holds: 20 ms + burst
    lines = [f"qdisc add dev {dev} parent 1:1 handle 10: htb default {len(fair_to) + 1:x}"]
    for k in range(1, len(fair_to) + 2):
        lines.append(
            f"class add dev {dev} parent 10: classid 10:{k:x} htb rate {mbit * 10}mbit "
            f"quantum {_FRAME} prio 0"
        )
        lines.append(f"qdisc add dev {dev} parent 10:{k:x} bfifo limit {limit}")
    for k, addr in enumerate(fair_to, start=1):
        lines.append(
            f"filter add dev {dev} parent 10: protocol ip prio 1 u32 match ip dst {addr}/32 "
            f"flowid 10:{k:x}"
        )
    batch = subprocess.run(
        [*ex, "tc", "-batch", "-"], input="\n".join(lines) + "\n", capture_output=True,
        text=True, timeout=30, check=False,
    )  # fmt: skip
    if batch.returncode != 0:
        raise HarnessError(f"fair queue on {dev}: {batch.stderr.strip() or batch.returncode}")


_FRAME = 1514
"""An Ethernet frame's bytes: the quantum each queue of a fair queue sends in its turn."""


@dataclass(frozen=True)
class Host:
    """One emulated host: its namespace, address, datacenter and the root-side veth end."""

    name: str
    ns: str
    ip: str
    dc: int
    peer: str

    @property
    def topology(self) -> dict[str, str]:
        return {"dc": f"dc{self.dc}", "rack": f"dc{self.dc}-r1", "host": self.name}


@dataclass
class Emulation:
    """`hosts[d]` hosts in datacenter d (1-based), each link at `rate_mbit`, the inter-dc
    link at `wan_mbit`. Use as a context manager; `setup()`/`teardown()` otherwise."""

    hosts_per_dc: dict[int, int]
    rate_mbit: float
    wan_mbit: float | None = None
    fair: bool = False  # each host's upload queue is fair across the hosts it sends to
    hosts: list[Host] = field(default_factory=list)
    _old_term: object = None

    def __post_init__(self) -> None:
        self.pid = os.getpid()
        self.tag = _tag(self.pid)
        self.net = 100 + self.pid % 100

    def gateway(self, dc: int) -> str:
        """The root namespace's address on dc's bridge (where hub replicas listen)."""
        return f"10.{self.net}.{dc}.254"

    def _addresses(self) -> list[str]:
        """Every address a host sends to: each host's, each datacenter's gateway."""
        out = []
        for dc, count in sorted(self.hosts_per_dc.items()):
            out += [f"10.{self.net}.{dc}.{i + 1}" for i in range(count)]
            out.append(self.gateway(dc))
        return out

    def router_ns(self) -> str:
        return f"{PREFIX}{self.pid}-router"

    def setup(self) -> Emulation:
        if os.geteuid() != 0:
            raise NeedsRoot("emulated hosts need root (network namespaces, veth, tc)")
        remove_stale()
        try:
            for dc, count in sorted(self.hosts_per_dc.items()):
                self._bridge(dc)
                for i in range(count):
                    self.hosts.append(self._host(dc, i))
            if len(self.hosts_per_dc) > 1:
                self._router()
        except BaseException:
            self.teardown()
            raise
        return self

    def teardown(self) -> None:
        """Kill every process left in our namespaces, delete them and our bridges."""
        _remove_run(self.pid)
        self.hosts = []

    def __enter__(self) -> Emulation:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        return self.setup()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.teardown()
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _bridge(self, dc: int) -> None:
        br = f"tb{self.tag}d{dc}"
        _sh("ip", "link", "add", br, "type", "bridge")
        _sh("ip", "addr", "add", f"{self.gateway(dc)}/24", "dev", br)
        _sh("ip", "link", "set", br, "up")

    def _host(self, dc: int, i: int) -> Host:
        ns = f"{PREFIX}{self.pid}-d{dc}h{i}"
        peer = f"tb{self.tag}h{dc}{i:02d}"
        ip = f"10.{self.net}.{dc}.{i + 1}"
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", peer, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _sh("ip", "link", "set", peer, "master", f"tb{self.tag}d{dc}", "up")
        ex = ("ip", "netns", "exec", ns)
        _sh(*ex, "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
        _sh(*ex, "ip", "link", "set", "eth0", "up")
        _sh(*ex, "ip", "link", "set", "lo", "up")
        _sh(*ex, "ip", "route", "add", f"10.{self.net}.0.0/16", "via", f"10.{self.net}.{dc}.253")
        _shape(ns, "eth0", self.rate_mbit, self._addresses() if self.fair else ())  # upload
        _shape(None, peer, self.rate_mbit)  # download
        return Host(f"d{dc}h{i}", ns, ip, dc, peer)

    def _router(self) -> None:
        ns = self.router_ns()
        _sh("ip", "netns", "add", ns)
        ex = ("ip", "netns", "exec", ns)
        _sh(*ex, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _sh(*ex, "ip", "link", "set", "lo", "up")
        for dc in self.hosts_per_dc:
            outer = f"tb{self.tag}r{dc}"
            _sh("ip", "link", "add", outer, "type", "veth", "peer", "name", f"r{dc}", "netns", ns)
            _sh("ip", "link", "set", outer, "master", f"tb{self.tag}d{dc}", "up")
            _sh(*ex, "ip", "addr", "add", f"10.{self.net}.{dc}.253/24", "dev", f"r{dc}")
            _sh(*ex, "ip", "link", "set", f"r{dc}", "up")
            if self.wan_mbit:
                _shape(ns, f"r{dc}", self.wan_mbit)

    def wan_tx_bytes(self, dc: int) -> int:
        """Bytes the router has sent into dc (the inter-dc link's counter in that direction)."""
        path = f"/sys/class/net/r{dc}/statistics/tx_bytes"
        return int(_sh("ip", "netns", "exec", self.router_ns(), "cat", path).strip())

    def link_bytes(self) -> dict[str, tuple[int, int]]:
        """Each host's link counters, host name -> (bytes into the host, bytes out of it),
        frames included: the `tx_bytes` and `rx_bytes` of the root-side end of its veth, the
        same link as its `eth0` (what that end sends, the host receives). Bytes that two
        namespaces exchange without their veths (cma, shared memory) are not counted."""
        out = {}
        for host in self.hosts:
            stats = f"/sys/class/net/{host.peer}/statistics"
            with open(f"{stats}/tx_bytes") as down, open(f"{stats}/rx_bytes") as up:
                out[host.name] = (int(down.read()), int(up.read()))
        return out

    def exec_argv(self, host: Host, argv: list[str]) -> list[str]:
        """`argv` run inside `host`'s namespace."""
        return ["ip", "netns", "exec", host.ns, *argv]


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
