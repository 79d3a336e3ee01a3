"""A network namespace made by the run, joined to the host by a veth pair.

One holder (a publisher) runs inside it, so its traffic crosses a real link that `tc tbf`
can squeeze (the kernel here has no netem). Host side `10.211.N.1/30`, namespace side
`10.211.N.2/30`; nothing is routed anywhere else. `close()` removes both, and is safe to
call twice or after a failed `create()`.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from tensorhub.errors import TensorHubError


class NetnsError(TensorHubError):
    """A namespace, veth or qdisc command failed."""

    code = "UNAVAILABLE"


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (None if they can)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


def _run(*args: str) -> None:
    try:
        subprocess.run(args, check=True, capture_output=True, timeout=10)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        stderr = getattr(exc, "stderr", b"") or b""
        raise NetnsError(f"{' '.join(args)}: {exc} {stderr.decode(errors='replace')}") from exc


class Namespace:
    """`thc{N}` with veth `thc{N}h` (host) / `thc{N}n` (inside); N is the run's pid."""

    def __init__(self, index: int) -> None:
        self.name = f"thc{index}"
        self.host_dev, self.ns_dev = f"{self.name}h", f"{self.name}n"
        subnet = 10 + index % 240
        self.host_ip, self.ns_ip = f"10.211.{subnet}.1", f"10.211.{subnet}.2"
        self._made = False

    def create(self) -> Namespace:
        self._made = True
        _run("ip", "netns", "add", self.name)
        _run("ip", "link", "add", self.host_dev, "type", "veth", "peer", "name", self.ns_dev)
        _run("ip", "link", "set", self.ns_dev, "netns", self.name)
        _run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_dev)
        _run("ip", "link", "set", self.host_dev, "up")
        self.exec("ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_dev)
        self.exec("ip", "link", "set", self.ns_dev, "up")
        self.exec("ip", "link", "set", "lo", "up")
        return self

    def exec(self, *args: str) -> None:
        _run("ip", "netns", "exec", self.name, *args)

    def prefix(self) -> list[str]:
        """The argv prefix that runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def squeeze(self, rate: str = "4mbit") -> None:
        """Token-bucket both directions of the link to `rate`."""
        tbf = ["tbf", "rate", rate, "burst", "16kb", "latency", "200ms"]
        self.exec("tc", "qdisc", "replace", "dev", self.ns_dev, "root", *tbf)
        _run("tc", "qdisc", "replace", "dev", self.host_dev, "root", *tbf)

    def unsqueeze(self) -> None:
        for args in (
            ["ip", "netns", "exec", self.name, "tc", "qdisc", "del", "dev", self.ns_dev, "root"],
            ["tc", "qdisc", "del", "dev", self.host_dev, "root"],
        ):
            subprocess.run(args, capture_output=True, timeout=10, check=False)

    def close(self) -> None:
        if not self._made and not os.path.exists(f"/run/netns/{self.name}"):
            return
        subprocess.run(
            ["ip", "link", "del", self.host_dev], capture_output=True, timeout=10, check=False
        )
        subprocess.run(
            ["ip", "netns", "del", self.name], capture_output=True, timeout=10, check=False
        )
        self._made = False
