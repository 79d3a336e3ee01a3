"""The CUDA half of same-host IPC: share a held version's device memory, and map it.

Holder side (`export`): each distinct storage of the version's tensors is shared with
`UntypedStorage._share_cuda_()` (a `cudaIpcMemHandle` for the allocation, torch's reference
counter, so the holder's caching allocator does not reuse memory a reader still maps, and
torch's own share event); an interprocess `torch.cuda.Event` is recorded on the current
stream, after every write the holder made through it. torch shares per call, so each lease
gets its own counters.

Reader side (`open_grant`): the grant's GPU is found by UUID among this process's devices,
each storage is opened with `UntypedStorage._new_shared_cuda` (torch's own rebuild path: it
takes every field as torch gave it, the event handle as bytes even when no sync is
required, and waits on the share event on the default stream), each tensor becomes a uint8
view of its storage, and the holder's event is opened for the copy stream to wait on.
Empty tensors share nothing (torch has no handle for an empty storage).

Nothing here runs without a CUDA device; every failure to open is `IpcIneligible`, which the
channel turns into a TCP fallback with that reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorhub.errors import IpcIneligible
from transport.checksums import wsum64_of_segments
from transport.ipc.fingerprint import local_fingerprint
from transport.ipc.protocol import IpcGrant, Storage
from transport.layout import Layout
from transport.store import HeldVersion

# torch's CUDA and storage-sharing calls are untyped; they are reached through these.
_cuda: Any = torch.cuda
_torch: Any = torch


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID, the same in every process whatever its CUDA_VISIBLE_DEVICES."""
    return str(torch.cuda.get_device_properties(device).uuid)


def local_device(uuid: str) -> int:
    """This process's number for the GPU `uuid`; `IpcIneligible` when it cannot see it."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", index)) == uuid:
            return index
    raise IpcIneligible(f"the holder's GPU {uuid} is not visible here (CUDA_VISIBLE_DEVICES)")


@dataclass
class Export:
    """One lease's share of a version: the grant to send, and what must stay alive until
    the lease ends (the event the reader waits on)."""

    grant: IpcGrant
    keep: object = None


def export(held: HeldVersion, probe_sum: int) -> Export:
    """Share `held`'s device memory for one lease (module docstring). `probe_sum` is
    wsum64 of chunk 0 (the caller computes it once per version). `IpcIneligible` for a
    version in host memory: it is read over TCP."""
    if not held.on_cuda:
        raise IpcIneligible("the version is in host memory here (CUDA IPC shares GPU memory)")
    tensors = list(held.tensors.values())
    device = tensors[0].device
    with _cuda.device(device):  # the event on the tensors' GPU, whatever this thread's is
        return _export(held, tensors, device, probe_sum)


def _export(
    held: HeldVersion, tensors: list[torch.Tensor], device: torch.device, probe_sum: int
) -> Export:
    storages: list[Storage] = []
    seen: dict[int, int] = {}
    places: list[tuple[int, int]] = []
    for t in tensors:
        storage: Any = t.untyped_storage()
        if not t.numel() or not storage.nbytes():  # nothing to share (torch has no handle)
            places.append((0, 0))
            continue
        key = int(storage.data_ptr())
        if key not in seen:
            _, handle, size, offset, ref, ref_off, ev, sync = storage._share_cuda_()
            seen[key] = len(storages)
            shared = Storage(bytes(handle), size, offset, bytes(ref), ref_off, bytes(ev), sync)
            storages.append(shared)
        places.append((seen[key], int(t.storage_offset()) * t.element_size()))
    written = _cuda.Event(interprocess=True)
    written.record(_cuda.current_stream(device))
    grant = IpcGrant(
        local_fingerprint(), device_uuid(device), held.epoch, bytes(written.ipc_handle()),
        tuple(storages), tuple(places), (0, probe_sum),
    )  # fmt: skip
    return Export(grant, written)


def probe_sum(held: HeldVersion) -> int:
    """wsum64 of chunk 0 as the holder's memory has it: the grant's probe."""
    return held.wsum64(0) if held.layout.num_chunks else 0


@dataclass
class Mapping:
    """A grant opened in this process: one uint8 view per layout tensor over the holder's
    memory, and the holder's event (a `torch.cuda.Event`). Dropping it unmaps."""

    flats: list[torch.Tensor]
    event: Any


def open_grant(grant: IpcGrant, layout: Layout) -> Mapping:
    """Map `grant`'s memory (module docstring); `IpcIneligible` when anything does not open
    or does not fit the layout."""
    if len(grant.places) != len(layout.tensors):
        raise IpcIneligible(
            f"the grant places {len(grant.places)} tensors, the layout has {len(layout.tensors)}"
        )
    index = local_device(grant.device_uuid)
    try:
        _cuda._lazy_init()
        opened = [_open_storage(index, s) for s in grant.storages]
        event = _cuda.Event.from_ipc_handle(torch.device("cuda", index), grant.event)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise IpcIneligible(f"the holder's CUDA IPC handles do not open here: {exc}") from exc
    flats = []
    for spec, (which, offset) in zip(layout.tensors, grant.places, strict=True):
        if not spec.nbytes:  # an empty tensor: nothing shared, nothing to copy
            flats.append(torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)))
            continue
        if which >= len(opened):
            raise IpcIneligible(f"the grant shares no storage for {spec.name!r}")
        storage = opened[which]
        if offset + spec.nbytes > storage.nbytes():
            raise IpcIneligible(f"the grant's storage for {spec.name!r} is too small for it")
        typed = _torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.uint8, _internal=True)
        flats.append(_torch._utils._rebuild_tensor(typed, offset, (spec.nbytes,), (1,)))
    return Mapping(flats, event)


def _open_storage(device: int, s: Storage) -> Any:
    """One shared storage opened in this process, as torch's own rebuild opens it."""
    return _torch.UntypedStorage._new_shared_cuda(
        device, s.handle, s.size, s.offset, s.ref_counter, s.ref_counter_offset,
        s.event, s.event_sync_required,
    )  # fmt: skip


def mapped_wsum64(mapping: Mapping, layout: Layout, index: int) -> int:
    """wsum64 of chunk `index` as the mapping shows it (on the device: 8 bytes back)."""
    return wsum64_of_segments(mapping.flats, layout.segments(index))


def new_stream(device: torch.device) -> Any:
    """A CUDA stream of its own for a channel's copies (a `torch.cuda.Stream`)."""
    return _cuda.Stream(device=device)


def copy_spans(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    spans: Sequence[tuple[int, int, int]],
    stream: Any,
    after: Any,
) -> None:
    """Copy each (tensor, start, length) span of `src` into `dst` on `stream`, after the
    holder's `after` event; returns once the copies are done (the caller then reports)."""
    with torch.cuda.stream(stream):
        stream.wait_event(after)
        for tensor, start, length in spans:
            dst[tensor][start : start + length].copy_(
                src[tensor][start : start + length], non_blocking=True
            )
    stream.synchronize()
