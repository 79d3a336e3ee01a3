#!/usr/bin/env bash
# Rewrite a lock: the exact versions a fresh machine installs (`make lock`, `make lock-NAME`).
#   scripts/lock.sh          -> scripts/lock.txt       (.venv: the project, dev, nixl)
#   scripts/lock.sh NAME     -> scripts/lock-NAME.txt  (.venv-NAME: engine NAME, then the project)
# It builds a throwaway venv with scripts/venv.sh --unlocked (the newest releases that
# pyproject.toml allows, torch pinned to the CPU build) and writes its `pip freeze --all`.
# Installs use the lock as pip constraints, so next month's machine gets what CI passed with.
# Commit a new lock only after `make test` (and, for an engine, `make test-engines`) pass.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:-dev}
if [ "$name" = dev ]; then out=scripts/lock.txt; else out=scripts/lock-$name.txt; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
scripts/venv.sh "$name" "$tmp/venv" --unlocked
py="$tmp/venv/bin/python"
{
  echo "# The lock of scripts/venv.sh $name: pip constraints, written by scripts/lock.sh $name"
  echo "# on $(date -u +%Y-%m-%d) with Python $("$py" -c 'import platform; print(platform.python_version())'). Do not edit: rerun it (README, \"Dependencies\")."
  "$py" -m pip freeze --all --exclude tensorhub
} > "$out"
echo "wrote $out ($(grep -vc '^#' "$out") pins)"
