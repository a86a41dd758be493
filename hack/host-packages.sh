#!/usr/bin/env bash
# Install the Debian packages the real nodes and the image builds need (containerd, runc, the
# CNI plugins, buildah, busybox-static, debootstrap, iptables), as root, when any is missing.
# A machine that has them all does nothing and needs no network.
#
#   hack/host-packages.sh [check]   exit 0 iff every package is installed
set -euo pipefail

PACKAGES=(containerd runc containernetworking-plugins buildah busybox-static debootstrap iptables nftables iproute2 util-linux)

missing() {
  local p
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$' || echo "$p"
  done
}

mapfile -t want < <(missing)
if [[ ${1:-} == check ]]; then
  ((${#want[@]} == 0)) || { echo "host-packages: missing: ${want[*]}" >&2; exit 1; }
  exit 0
fi
((${#want[@]})) || exit 0
[[ $(id -u) == 0 ]] || { echo "host-packages: run as root to install: ${want[*]}" >&2; exit 1; }
echo "host-packages: installing ${want[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null
