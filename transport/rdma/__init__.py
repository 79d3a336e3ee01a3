"""RDMA data plane: one-sided reads of a holder's tensors with pyverbs (docs/design.md,
"The mutability contract").

Protocol, one RC connection per (reader, holder):

1. reader: ``r = RdmaReader(dev)``; send ``encode_endpoint(r.endpoint())`` over the TCP
   control channel;
2. holder: ``desc = exporter.accept(decode_endpoint(msg))``; send ``encode_descriptor(desc)``;
3. reader: ``r.connect(decode_descriptor(reply))``; then
   ``r.read(name, r.register(dst), offset=..., length=...)`` per chunk.

Reads are checked against the holder's epoch word (`seqlock`); a torn chunk raises
`tensorhub.errors.TornRead`. Nothing here imports pyverbs at import time: `rdma_available()`
says whether the RDMA path can be used, and `rdma_unavailable_reason()` why not. See
docs/rdma.md.
"""

from transport.rdma.availability import rdma_available, rdma_unavailable_reason
from transport.rdma.descriptor import (
    QpInfo,
    RdmaDescriptor,
    RegionInfo,
    decode_descriptor,
    decode_endpoint,
    encode_descriptor,
    encode_endpoint,
)
from transport.rdma.device import RdmaDevice
from transport.rdma.exporter import RdmaExporter
from transport.rdma.reader import LocalBuffer, RdmaReader, plan_reads
from transport.rdma.seqlock import bump_epoch, epoch_ok

__all__ = [
    "LocalBuffer",
    "QpInfo",
    "RdmaDescriptor",
    "RdmaDevice",
    "RdmaExporter",
    "RdmaReader",
    "RegionInfo",
    "bump_epoch",
    "decode_descriptor",
    "decode_endpoint",
    "encode_descriptor",
    "encode_endpoint",
    "epoch_ok",
    "plan_reads",
    "rdma_available",
    "rdma_unavailable_reason",
]
