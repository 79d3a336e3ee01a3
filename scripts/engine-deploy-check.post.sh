#!/usr/bin/env bash
# After the deploy-check extra (scripts/venv.sh deploy-check VENV): the one tool of
# tests/engines/deploy_check that is not a Python package, systemd-analyze (for `verify` of
# deploy/systemd). Debian ships it in the systemd package; installing it starts nothing in a
# container. Without root or apt the systemd test skips and says why.
set -euo pipefail
if command -v systemd-analyze >/dev/null; then exit 0; fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends systemd
else
  echo "systemd-analyze not found, and not root with apt-get: the systemd check will skip" >&2
fi
