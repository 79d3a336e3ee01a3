#!/usr/bin/env bash
# Build a virtual environment of the project: the one installer of `make setup`, of
# `make test-engines` and of the locks (scripts/lock.sh).
#   scripts/venv.sh dev VENV    the project, its dev tools and NIXL (.venv, `make setup`)
#   scripts/venv.sh NAME VENV   the environment of engine NAME (.venv-NAME, `make test-engines`):
#                               the extra NAME alone first, as a user's environment holds it;
#                               then the project with its dev tools, constrained by that
#                               environment's own `pip freeze`, so that installing tensorhub
#                               beside the engine upgrades nothing the engine brought (pip
#                               fails if it would have to).
# Versions come from the lock, scripts/lock.txt or scripts/lock-NAME.txt; with --unlocked,
# from the newest releases pyproject.toml allows (what scripts/lock.sh records). torch is
# pinned to 2.13.0 in every install: a CPU build on these machines' disk, where an unpinned
# torch pulls a multi-GB CUDA build. An engine that needs more than its extra (packages to
# drop, a binary) has scripts/engine-NAME.post.sh, run with the venv's path at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: scripts/venv.sh dev|ENGINE VENV [--unlocked]"
name=${1:?$usage}
venv=${2:?$usage}
python=${PYTHON:-python3}
if [ "$name" = dev ]; then lock=scripts/lock.txt; else lock=scripts/lock-$name.txt; fi
if [ "${3:-}" = --unlocked ]; then
  lock=scripts/constraints.txt
elif [ ! -f "$lock" ]; then
  echo "venv.sh: no $lock; write it with scripts/lock.sh $name" >&2
  exit 2
fi
test -x "$venv/bin/python" || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q -c "$lock" --upgrade pip
"${pip[@]}" install -q -c "$lock" torch==2.13.0
if [ "$name" = dev ]; then
  "${pip[@]}" install -q -c "$lock" -e '.[dev,nixl]'
else
  mapfile -t extra < <("$venv/bin/python" -c 'import sys, tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"][sys.argv[1]]))' "$name")
  "${pip[@]}" install -q -c "$lock" "${extra[@]}"
  "${pip[@]}" freeze --all > "$venv/engine-freeze.txt"
  "${pip[@]}" install -q -c "$lock" -c "$venv/engine-freeze.txt" -e ".[dev,$name]"
fi
if [ "$name" != dev ] && [ -x "scripts/engine-$name.post.sh" ]; then
  "scripts/engine-$name.post.sh" "$venv"
fi
touch "$venv/.installed"
