"""NIXL as a transport (docs/nixl.md): one-sided READs through NVIDIA's NIXL and its UCX
backend (RDMA, CUDA IPC, cma or TCP, whichever UCX finds), with the agent metadata handed
out over a control channel of the holder's own after the read token is checked.

The holder side is `NixlHolder` (transport/nixl/holder.py), the reader side `NixlReader`
and its `NixlChannel`s (transport/nixl/reader.py). NIXL itself is optional
(`pip install 'tensorhub[nixl]'`): nothing here imports it before one of those is built, and
it is always imported through `transport.nixl.loader.load`, which keeps NIXL processes from
crashing at exit on hosts with Debian's rdma-core providers.
"""

from transport.nixl.holder import NixlHolder
from transport.nixl.loader import load, unavailable_reason
from transport.nixl.reader import NixlChannel, NixlReader

__all__ = ["NixlChannel", "NixlHolder", "NixlReader", "load", "unavailable_reason"]
