#!/usr/bin/env bash
# The declared floors are true (`make check-floors`; CI runs it): install the project at the
# lowest version pyproject.toml allows for each of its direct dependencies (uv's
# `--resolution lowest-direct`; torch held at the pinned CPU build, the one torch on these
# machines), check that those floors are what got installed, then run a focused subset
# there: the SDK round trip, the delta codec and delta fetch, the hub's gRPC start, and
# scripts/roundtrip.py. The test tools come from the lock; they are not the project's.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-floors
python=${PYTHON:-python3}
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q -c scripts/lock.txt --upgrade pip
"$venv/bin/python" -m pip install -q -c scripts/lock.txt torch==2.13.0 pytest pytest-timeout hypothesis safetensors
.venv/bin/uv pip install -q --python "$venv/bin/python" --resolution lowest-direct \
  -c scripts/constraints.txt -e .
"$venv/bin/python" scripts/floors.py --installed
"$venv/bin/python" scripts/roundtrip.py
"$venv/bin/python" -m pytest -q -p no:cacheprovider \
  tests/ros/test_sdk_basic.py tests/transport/test_delta_codec.py tests/ros/test_delta.py \
  tests/ros/test_service.py::test_health_and_reflection
