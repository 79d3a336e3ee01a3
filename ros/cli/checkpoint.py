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
(`CARRIED`, the allow-list of `ros.manifest_check`) are read too, for `ros.cli.carry` to put
in the manifest; each is sized first (`stat`), and one over `MAX_CARRIED_FILE_BYTES` is left
behind unread (no file that size fits the manifest's 64 KiB).

A checkpoint is read as it lies, so its files must lie in it: every file read from a
directory (weights, index, carried files) must resolve, links followed, to a path inside
the directory; a link out of it is refused, as it would publish a file of this machine to
every reader. The one exception is a Hugging Face cache snapshot
(`models--ORG--NAME/snapshots/REVISION/`), whose files are links into the same repository's
`blobs/`: those are accepted.

Everything here runs before the command connects: a missing path, a file of another format,
a broken or oversized header or index, a link out of the directory, a tensor name no
manifest may hold is an `InvalidArgument` (`InvalidManifest` for the name) that names the
path, and nothing has reached the hub.
"""

from __future__ import annotations

import logging
import os
import pickle
import stat
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ros.cli.safetensors_io import MAX_TENSORS, looks_like_safetensors, map_file
from ros.cli.untrusted_json import Limits, load
from ros.manifest_check import CARRIED_FILES, check_tensor_name
from tensorhub.errors import InvalidArgument, InvalidManifest

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# The files that make a directory loadable without the weights' own code, in this order of
# priority (what does not fit the manifest's metadata is left behind from the end): the
# allow-list the hub and every fetcher hold carried files to.
CARRIED = CARRIED_FILES
MAX_CARRIED_FILE_BYTES = 1 << 20  # larger ones cannot fit 64 KiB compressed: not read
MAX_INDEX_BYTES = 64 << 20
# An index maps each tensor to its file (2 values each), beside a little metadata.
_INDEX_LIMITS = Limits(
    max_bytes=MAX_INDEX_BYTES, max_depth=4, max_members=MAX_TENSORS + 1024,
    max_values=2 * MAX_TENSORS + 4096,
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
    too_big: dict[str, int] = field(default_factory=dict)  # left behind unread: name -> size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def open_checkpoint(path: Path, *, carry: bool = True) -> Checkpoint:
    """Open `path` (see the module docstring); `InvalidArgument` naming what is wrong."""
    if not path.exists():
        raise InvalidArgument(f"{path}: no such file or directory")
    if path.is_dir():
        within = Within.of(path)
        found = _open_directory(path, within)
        if carry:
            found.carried, found.too_big = _carried(path, within)
    else:
        found = _open_file(path)
    if not found.tensors:
        raise InvalidArgument(f"{path}: holds no tensors: nothing to publish")
    if len(found.tensors) > MAX_TENSORS:
        raise InvalidArgument(f"{path}: {len(found.tensors)} tensors (at most {MAX_TENSORS})")
    for name in found.tensors:
        try:
            check_tensor_name(name)
        except InvalidManifest as exc:
            raise InvalidManifest(f"{path}: {exc}") from None
    return found


@dataclass(frozen=True)
class Within:
    """Where the files of a checkpoint directory may lead, links followed: inside the
    directory, and for a Hugging Face cache snapshot (`models--*/snapshots/REVISION/`, or a
    folder in one) also to a file of that repository's `blobs/`, where the cache keeps the
    bytes its snapshots link to (`../../blobs/HASH`)."""

    directory: Path  # resolved
    blobs: Path | None  # a real directory (no link); None unless the directory is in a snapshot

    @classmethod
    def of(cls, path: Path) -> Within:
        directory = path.resolve()
        for folder in (directory, *directory.parents):
            snapshots = folder.parent
            if snapshots.name == "snapshots" and snapshots.parent.name.startswith("models--"):
                # blobs/'s parents are real (`directory` is resolved); a blobs/ that is
                # itself a link could lead anywhere, and then grants nothing
                blobs = snapshots.parent / "blobs"
                real = blobs.is_dir() and not blobs.is_symlink()
                return cls(directory, blobs if real else None)
        return cls(directory, None)

    def resolve(self, file: Path) -> Path:
        """`file` (a path in the directory) with its links followed; `InvalidArgument` if
        they lead out of the checkpoint."""
        if "\0" in str(file):
            raise InvalidArgument(f"{str(file)!r}: a file name with a NUL byte")
        try:
            real = file.resolve()
        except (OSError, RuntimeError) as exc:  # a loop of links, a name too long
            raise InvalidArgument(f"{file}: cannot follow its links: {exc}") from None
        if self.directory in real.parents:
            return real
        if self.blobs is not None and real.parent == self.blobs:
            return real
        where = f"{self.directory}" + ("" if self.blobs is None else f" or {self.blobs}")
        raise InvalidArgument(
            f"{file} leads to {real}, outside the checkpoint ({where}): refused, as it "
            "would publish a file from outside the checkpoint to every reader; copy the "
            "file into the directory"
        )


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


def _open_directory(path: Path, within: Within) -> Checkpoint:
    index = path / INDEX
    weight_map: dict[str, str] | None = None
    if index.exists() or index.is_symlink():
        weight_map = _load_index(index, within)
        files = _indexed_files(index, weight_map, within)
    elif (path / SINGLE).exists() or (path / SINGLE).is_symlink():
        files = [within.resolve(path / SINGLE)]
    else:
        found = sorted(path.glob("*.safetensors"))
        if len(found) != 1:
            others = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
            hint = f"; for a torch file pass it itself ({', '.join(others)})" if others else ""
            raise InvalidArgument(
                f"{path}: no {INDEX}, no {SINGLE}, and {len(found)} *.safetensors files: "
                f"not a save_pretrained directory{hint}"
            )
        files = [within.resolve(found[0])]
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        _, mapped = map_file(file, MAX_TENSORS - len(tensors))
        for name, tensor in mapped.items():
            if name in tensors:
                raise InvalidArgument(f"{path}: tensor {name!r} is in two files")
            tensors[name] = tensor
    if weight_map is not None:
        _check_index(index, weight_map, tensors)
    return Checkpoint(path, "save_pretrained", files, tensors)


def _load_index(index: Path, within: Within) -> dict[str, str]:
    """The index's weight_map, its size bounded before it is read (`MAX_INDEX_BYTES`) and
    its JSON before it is parsed (`_INDEX_LIMITS`)."""
    real = within.resolve(index)
    try:
        size = real.stat().st_size
        if size > MAX_INDEX_BYTES:
            raise InvalidArgument(
                f"{index}: {size} bytes, not an index (at most {MAX_INDEX_BYTES})"
            )
        with open(real, "rb") as f:
            raw = f.read(MAX_INDEX_BYTES + 1)
    except OSError as exc:
        raise InvalidArgument(f"{index}: not a readable index: {exc}") from None
    parsed = load(raw, f"{index}: not a readable index", _INDEX_LIMITS)
    weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise InvalidArgument(f"{index}: no weight_map of tensor names to files")
    return weight_map


def _indexed_files(index: Path, weight_map: Mapping[str, str], within: Within) -> list[Path]:
    files = []
    for name in dict.fromkeys(weight_map.values()):  # in order, once each
        if not name or "\0" in name or os.path.isabs(name):
            raise InvalidArgument(f"{index}: names {name!r:.80}, not a file of its directory")
        file = within.resolve(index.parent / name)
        if not file.is_file():
            raise InvalidArgument(f"{index}: names {name!r}, which does not exist")
        files.append(file)
    return files


def _check_index(
    index: Path, weight_map: Mapping[str, str], tensors: Mapping[str, torch.Tensor]
) -> None:
    named = set(weight_map)
    if named != tensors.keys():
        missing = sorted(named - tensors.keys())[:3]
        extra = sorted(tensors.keys() - named)[:3]
        raise InvalidArgument(
            f"{index}: its weight_map and its files differ (in the index only: {missing}; "
            f"in the files only: {extra})"
        )


def _carried(path: Path, within: Within) -> tuple[dict[str, bytes], dict[str, int]]:
    """The `CARRIED` files of the directory (name -> bytes), and those over
    `MAX_CARRIED_FILE_BYTES` (name -> size), sized by `stat` and not read. A file that is
    not a regular file (a directory, a FIFO, a device) is no carried file: skipped."""
    carried: dict[str, bytes] = {}
    too_big: dict[str, int] = {}
    for name in CARRIED:
        file = path / name
        if not (file.exists() or file.is_symlink()):
            continue
        real = within.resolve(file)
        try:
            st = real.stat()
            if not stat.S_ISREG(st.st_mode):
                continue
            if st.st_size > MAX_CARRIED_FILE_BYTES:
                too_big[name] = st.st_size
                continue
            with open(real, "rb") as f:
                data = f.read(MAX_CARRIED_FILE_BYTES + 1)  # the file may have grown
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise InvalidArgument(f"{file}: cannot read it: {exc.strerror or exc}") from None
        if len(data) > MAX_CARRIED_FILE_BYTES:
            too_big[name] = len(data)
        else:
            carried[name] = data
    return carried, too_big
