"""Spill a held version to a safetensors file and keep serving it from the file.

docs/design.md, "Retention": the last complete holder of a retained version may not release it
silently. With a spill target it need not: the tensors are written once to a safetensors
file, the file is memory-mapped, and the holder serves the version from the mapping (the page
cache) instead of from the caller's memory, which is then free to be overwritten. The file
is a standard safetensors file (readable by `safetensors.torch.load_file`).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

from tensorhub.errors import InvalidArgument

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
_FROM_NAME = {v: k for k, v in _DTYPES.items()}
_ALIGN = 8


def write_safetensors(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor]) -> None:
    """Write `tensors` (CPU or CUDA, contiguous) to `path` atomically (temp file + rename)."""
    header: dict[str, object] = {}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _DTYPES:
            raise InvalidArgument(
                f"cannot spill {name!r}: dtype {tensor.dtype} has no safetensors name"
            )
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}  # fmt: skip
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _ALIGN)  # the spec allows trailing spaces; aligns the data
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for tensor in tensors.values():
            flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            out.write(flat.numpy().data)
        out.flush()
        os.fsync(out.fileno())
    tmp.replace(target)


def map_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as read-only views of a private memory map (no copy,
    except of a tensor whose offset is not aligned to its element size)."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    (size,) = struct.unpack("<Q", mapped[:8])
    header = json.loads(mapped[8 : 8 + size])
    base = 8 + size
    out: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _FROM_NAME[entry["dtype"]]
        start, end = entry["data_offsets"]
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = (end - start) // itemsize
        if count == 0:
            out[name] = torch.empty(entry["shape"], dtype=dtype)
        elif (base + start) % itemsize:
            raw = torch.frombuffer(
                mapped, dtype=torch.uint8, count=end - start, offset=base + start
            )
            out[name] = raw.clone().view(dtype).reshape(entry["shape"])
        else:
            view = torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + start)
            out[name] = view.reshape(entry["shape"])
    return out
