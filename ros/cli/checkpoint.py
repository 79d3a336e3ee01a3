"""What `tensorhub publish` reads: a checkpoint on disk, opened memory-mapped, or a named error.

PATH may be
- a safetensors file;
- a directory as `save_pretrained` writes it: `model.safetensors.index.json` and the shards
  it names, or a single `model.safetensors` (or one `*.safetensors` file);
- a torch state-dict file (`torch.save(model.state_dict(), PATH)`), loaded with
  `torch.load(weights_only=True, mmap=True)`: no pickled code runs, and the tensors stay in
  the file's mapping (an old, non-zip file cannot be mapped and is read into memory, logged).

Every tensor is a view of a file mapping, so publishing a checkpoint costs page cache, not
a copy of the model. A directory's `config.json`, generation config and tokenizer files
(`CARRIED`) are read too, for `ros.cli.carry` to put in the manifest.

Everything here runs before the command connects: a missing path, a file of another format,
a broken header or index is an `InvalidArgument` that names the path, and nothing has reached
the hub.
"""

from __future__ import annotations

import json
import logging
import pickle
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ros.cli.safetensors_io import looks_like_safetensors, map_file
from tensorhub.errors import InvalidArgument

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# The files that make a directory loadable without the weights' own code: in this order of
# priority (what does not fit the manifest's metadata is left behind from the end).
CARRIED = (
    "config.json", "generation_config.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json", "tokenizer.json", "tokenizer.model",
    "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
)  # fmt: skip
_ZIP = b"PK\x03\x04"
_PICKLE = b"\x80"


@dataclass
class Checkpoint:
    """A checkpoint opened for publishing: its tensors (views of file mappings), the weight
    files they come from, and the carried files' bytes by name."""

    path: Path
    kind: str  # "safetensors", "save_pretrained", "torch"
    files: list[Path]
    tensors: dict[str, torch.Tensor]
    carried: dict[str, bytes] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def open_checkpoint(path: Path, *, carry: bool = True) -> Checkpoint:
    """Open `path` (see the module docstring); `InvalidArgument` naming what is wrong."""
    if not path.exists():
        raise InvalidArgument(f"{path}: no such file or directory")
    if path.is_dir():
        found = _open_directory(path)
        if carry:
            found.carried = _carried(path)
    else:
        found = _open_file(path)
    if not found.tensors:
        raise InvalidArgument(f"{path}: holds no tensors: nothing to publish")
    return found


def _open_file(path: Path) -> Checkpoint:
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as exc:
        raise InvalidArgument(f"{path}: cannot read it: {exc.strerror or exc}") from None
    if looks_like_safetensors(head):
        _, tensors = map_file(path)
        return Checkpoint(path, "safetensors", [path], tensors)
    if head.startswith(_ZIP) or head.startswith(_PICKLE):
        tensors = _torch_state_dict(path, mmap=head.startswith(_ZIP))
        return Checkpoint(path, "torch", [path], tensors)
    raise InvalidArgument(
        f"{path}: neither a safetensors file nor a torch state dict (it starts {head[:8]!r}); "
        "pass a .safetensors file, a save_pretrained directory or a torch.save file"
    )


def _torch_state_dict(path: Path, *, mmap: bool) -> dict[str, torch.Tensor]:
    if not mmap:
        log.warning("%s: an old (non-zip) torch file cannot be memory-mapped: read into memory",
                    path)  # fmt: skip
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:  # weights_only refused an object
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidArgument(
            f"{path}: not a plain state dict (torch.load(weights_only=True) refused it: {first})"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as exc:
        raise InvalidArgument(f"{path}: not a readable torch file: {exc}") from None
    return _flat_tensors(path, loaded)


def _flat_tensors(path: Path, loaded: object) -> dict[str, torch.Tensor]:
    """The state dict itself: a mapping of names to tensors, nothing nested."""
    if not isinstance(loaded, Mapping):
        raise InvalidArgument(f"{path}: holds a {type(loaded).__name__}, not a state dict")
    tensors: dict[str, torch.Tensor] = {}
    for name, value in loaded.items():
        if not isinstance(name, str):
            raise InvalidArgument(f"{path}: key {name!r} is not a tensor name")
        if not isinstance(value, torch.Tensor):
            raise InvalidArgument(
                f"{path}: {name!r} is a {type(value).__name__}, not a tensor: PATH must hold "
                f"a flat state dict (name -> tensor){_nested_hint(loaded)}"
            )
        tensors[name] = value
    return tensors


def _nested_hint(loaded: Mapping[object, object]) -> str:
    """Where a training checkpoint keeps its state dict, if one entry is one."""
    for key, value in loaded.items():
        if (
            isinstance(value, Mapping)
            and value
            and all(isinstance(t, torch.Tensor) for t in value.values())
        ):
            return (
                f"; its {key!r} is one ({len(value)} tensors): "
                f"torch.save(checkpoint[{key!r}], NEW_PATH) and publish that"
            )
    return ""


def _open_directory(path: Path) -> Checkpoint:
    index = path / INDEX
    if index.exists():
        files = _indexed_files(index)
    elif (path / SINGLE).exists():
        files = [path / SINGLE]
    else:
        found = sorted(path.glob("*.safetensors"))
        if len(found) != 1:
            others = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
            hint = f"; for a torch file pass it itself ({', '.join(others)})" if others else ""
            raise InvalidArgument(
                f"{path}: no {INDEX}, no {SINGLE}, and {len(found)} *.safetensors files: "
                f"not a save_pretrained directory{hint}"
            )
        files = found
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        _, mapped = map_file(file)
        for name, tensor in mapped.items():
            if name in tensors:
                raise InvalidArgument(f"{path}: tensor {name!r} is in two files")
            tensors[name] = tensor
    if index.exists():
        _check_index(index, files, tensors)
    return Checkpoint(path, "save_pretrained", files, tensors)


def _load_index(index: Path) -> dict[str, str]:
    try:
        parsed = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"{index}: not a readable index: {exc}") from None
    weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise InvalidArgument(f"{index}: no weight_map of tensor names to files")
    return weight_map


def _indexed_files(index: Path) -> list[Path]:
    files = []
    for name in dict.fromkeys(_load_index(index).values()):  # in order, once each
        file = (index.parent / name).resolve()
        if index.parent.resolve() not in file.parents:
            raise InvalidArgument(f"{index}: names {name!r}, outside its directory")
        if not file.is_file():
            raise InvalidArgument(f"{index}: names {name!r}, which does not exist")
        files.append(file)
    return files


def _check_index(index: Path, files: list[Path], tensors: Mapping[str, torch.Tensor]) -> None:
    named = set(_load_index(index))
    if named != tensors.keys():
        missing = sorted(named - tensors.keys())[:3]
        extra = sorted(tensors.keys() - named)[:3]
        raise InvalidArgument(
            f"{index}: its weight_map and its files differ (in the index only: {missing}; "
            f"in the files only: {extra})"
        )


def _carried(path: Path) -> dict[str, bytes]:
    carried: dict[str, bytes] = {}
    for name in CARRIED:
        file = path / name
        if file.is_file():
            try:
                carried[name] = file.read_bytes()
            except OSError as exc:
                raise InvalidArgument(f"{file}: cannot read it: {exc.strerror or exc}") from None
    return carried
