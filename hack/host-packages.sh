#!/usr/bin/env bash
# Install the Debian packages the real nodes and the image builds need (containerd, runc, the
# CNI plugins, buildah, busybox-static, debootstrap, iptables; jq for the Kueue webhooks'
# configuration), as root, when any is missing.
# A machine that has them all does nothing and needs no network. No package's service is
# started: the tests start what they need themselves.
#
#   hack/host-packages.sh [check]   exit 0 iff every package is installed
set -euo pipefail

PACKAGES=(containerd runc containernetworking-plugins buildah busybox-static debootstrap iptables nftables iproute2 util-linux
  jq)

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
# Without systemd, maintainer scripts start services through invoke-rc.d: forbid it
# (exit 101) while installing, unless the machine already has a policy of its own.
policy=/usr/sbin/policy-rc.d
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"
  trap 'rm -f "$policy"' EXIT
fi
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null
