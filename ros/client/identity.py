"""Who a client is, fixed when it connects: what its helpers read of it, and nothing else."""

from __future__ import annotations

import os
import re
import secrets
import socket
from dataclasses import dataclass

from transport.tls import TlsConfig
from transport.topology import Topology

DEFAULT_TIMEOUT = 10.0  # the default deadline of one hub call (s)


def default_holder_name() -> str:
    """`{host}-{pid}-{random}`, squeezed into the name pattern."""
    host = re.sub(r"[^a-z0-9._-]", "-", socket.gethostname().lower()).strip("-.")[:40] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class Identity:
    """A client's tenant, holder name and topology (what holders and the hub see of it), the
    TLS it reads with, and its default deadline of one hub call."""

    tenant: str
    holder_name: str
    topology: Topology
    tls: TlsConfig | None
    timeout: float = DEFAULT_TIMEOUT
