#!/usr/bin/env bash
# The wheel users install works (`make check-install`; CI runs it): build it with
# `python -m build`, install it into a fresh venv (torch the pinned CPU build, the rest at the
# lock's versions), and run `tensorhub --help` and scripts/roundtrip.py from outside the
# working tree, so that the wheel's own files are what gets imported.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
rm -rf dist
.venv/bin/python -m build -q --wheel --outdir dist . >/dev/null
wheel=$(ls dist/tensorhub-*.whl)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m venv "$tmp/venv"
pip=("$tmp/venv/bin/python" -m pip)
"${pip[@]}" install -q -c scripts/lock.txt --upgrade pip
"${pip[@]}" install -q -c scripts/lock.txt torch==2.13.0 "$wheel"
cp scripts/roundtrip.py "$tmp/"
cd "$tmp"
where=$(venv/bin/python -c 'import ros; print(ros.__file__)')
case "$where" in
  "$tmp/venv/"*) ;;
  *) echo "check-install: ros imported from $where, not from the wheel" >&2; exit 1 ;;
esac
venv/bin/tensorhub --help >/dev/null
venv/bin/python roundtrip.py
echo "check-install: $(basename "$wheel") installs, imports from the venv, and round-trips"
