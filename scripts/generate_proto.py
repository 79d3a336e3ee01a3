"""Regenerate the Python code for the hub's protos (`make proto`): a tool of the
repository, not shipped in the wheel.

`make proto` runs this file with the pinned generator of scripts/proto-lock.txt
(`.venv-proto`), since the generator's versions become the floors of the generated code;
CI regenerates and compares, and tests/ros/test_service.py checks the committed descriptor
against the .proto with whatever protoc the dev environment has.

Protos are compiled with the repository root as the include path, so each registers in
protobuf's descriptor pool under `ros/proto/tensorhub/v1/...`, a name that can never clash
with etcd's own `kv.proto`/`rpc.proto` (which python3-etcd3 registers too).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "ros" / "proto" / "tensorhub" / "v1"


def protos() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path = ROOT, python: str = sys.executable) -> None:
    """Run grpc_tools.protoc for every proto, writing *_pb2.py, *_pb2.pyi, *_pb2_grpc.py.

    The compiler runs in a process of its own (`python -m grpc_tools.protoc`), never imported
    here: its extension and the abseil that NIXL's wheel bundles cannot share a process
    (loading either after the other crashed with SIGSEGV or SIGABRT, nixl-cu12 1.5.1 with
    grpcio-tools), and the test suite, which checks the generated code, loads NIXL."""
    for proto in protos():
        args = [
            python, "-m", "grpc_tools.protoc",
            f"-I{ROOT}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(proto.relative_to(ROOT)),
        ]  # fmt: skip
        done = subprocess.run(args, check=False, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            sys.exit(f"protoc failed for {proto} (exit {done.returncode}): {done.stderr.strip()}")


if __name__ == "__main__":
    generate()
