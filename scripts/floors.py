"""The project's dependency floors, and what the generated gRPC code demands.

- `python scripts/floors.py` prints each direct dependency's floor and the versions the
  generated code under ros/proto demands.
- `--installed` checks that this environment holds each direct dependency at exactly its
  floor (torch excepted: it is held at the pinned CPU build); scripts/check-floors.sh runs it
  after installing the lowest direct versions, so that the run tests the floors and nothing
  newer.

tests/test_floors.py uses the same readers to keep pyproject.toml, the generated code and
scripts/proto-lock.txt in agreement.
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "ros" / "proto" / "tensorhub" / "v1"
HELD = {"torch"}  # installed at the pinned CPU build, whatever its floor


def requirements(extra: str | None = None) -> dict[str, Requirement]:
    """pyproject.toml's direct dependencies (or those of one extra), by normalized name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    reqs = (Requirement(line) for line in listed)
    return {canonical(r.name): r for r in reqs}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def floor(req: Requirement) -> Version | None:
    """The lowest version `req` admits by a `>=` or `==` bound (None if it has none)."""
    bounds = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
    return max(bounds) if bounds else None


def grpc_generated() -> Version:
    """The grpcio the generated stubs refuse to run below (their GRPC_GENERATED_VERSION)."""
    text = (GENERATED / "hub_pb2_grpc.py").read_text()
    match = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'", text, re.MULTILINE)
    if match is None:
        raise SystemExit("hub_pb2_grpc.py names no GRPC_GENERATED_VERSION")
    return Version(match.group(1))


def protobuf_gencode() -> Version:
    """The protobuf version of the generated messages (the runtime must be at least this,
    in this major or the next)."""
    text = (GENERATED / "hub_pb2.py").read_text()
    match = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,"
        r"\s*(\d+),\s*(\d+),\s*(\d+),",
        text,
    )
    if match is None:
        raise SystemExit("hub_pb2.py validates no protobuf runtime version")
    return Version(".".join(match.groups()))


def pins(path: Path) -> dict[str, Version]:
    """A lock or constraints file's `name==version` lines, by normalized name."""
    found: dict[str, Version] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            found[canonical(name)] = Version(version)
    return found


def check_installed() -> list[str]:
    """Each direct dependency not at its floor in this environment, described."""
    wrong = []
    for name, req in requirements().items():
        want = floor(req)
        have = Version(metadata.version(name))
        if name in HELD or want is None:
            print(f"{name:24} {have!s:12} (held; floor {want})")
            continue
        print(f"{name:24} {have!s:12} floor {want}")
        if have != want:
            wrong.append(f"{name} {have} installed, floor {want}")
    return wrong


def main(argv: list[str]) -> int:
    if "--installed" in argv:
        wrong = check_installed()
        for line in wrong:
            print(f"not at its floor: {line}", file=sys.stderr)
        return 1 if wrong else 0
    for name, req in requirements().items():
        print(f"{name:24} {req.specifier}")
    print(f"generated code: grpcio >= {grpc_generated()}, protobuf gencode {protobuf_gencode()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
