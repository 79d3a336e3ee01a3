#!/usr/bin/env bash
# Build .venv-NAME for `make test-engines`: the project, its dev tools and the extra NAME
# (pyproject.toml), in an environment of its own, since the engines' dependencies do not
# all fit in one. torch stays pinned to 2.13.0 (a CPU build on these machines; an unpinned
# torch pulls a multi-GB CUDA build), for every install: scripts/constraints.txt.
# An engine that needs more than its extra (packages to drop, a binary) has
# scripts/engine-NAME.post.sh, run with the venv's path once the extra is in.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: scripts/engine-venv.sh NAME}
venv=.venv-$name
python=${PYTHON:-python3}
test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch==2.13.0
"$venv/bin/python" -m pip install -q -c scripts/constraints.txt -e ".[dev,$name]"
if [ -x "scripts/engine-$name.post.sh" ]; then "scripts/engine-$name.post.sh" "$venv"; fi
touch "$venv/.installed"
