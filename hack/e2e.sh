#!/usr/bin/env bash
# The end-to-end path on this machine, without Docker: real nodes (a kubelet and a
# containerd each, hack/cluster.sh up --real-nodes 2), the images (Tetrad's two and
# the bring-your-own examples') built with buildah (hack/images.sh) and imported
# into the nodes' containerd, the chart
# installed, then the quickstart applied and watched until it succeeds.
# hack/e2e-kind.sh is the same path for machines with Docker.
#
#   hack/e2e.sh [demo]    all of it (`make e2e`); the cluster stays up afterwards
#   hack/e2e.sh install   images and chart into a running real-node cluster
#                         (what the e2e tests' fixture calls)
#   hack/e2e.sh down      take the cluster down (every host change undone)
#
# Environment: TETRAD_CLUSTER_NAME (default e2e), TETRAD_E2E_TIMEOUT (default 1200 s).
# Root only (bridges, cgroups, containerd, buildah).
set -euo pipefail

HACK=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HACK")
NAME=${TETRAD_CLUSTER_NAME:-e2e}
TIMEOUT=${TETRAD_E2E_TIMEOUT:-1200}
NS=tetrad-system
BIN=$("$HACK/k8s-tools.sh" bindir)
export TETRAD_CLUSTER_NAME=$NAME

log() { echo "e2e[$NAME]: $*" >&2; }
kctl() { "$BIN/kubectl" --kubeconfig "$("$HACK/cluster.sh" kubeconfig)" "$@"; }

install() {
  local t0=$SECONDS operator trainer script hf
  operator=$("$HACK/images.sh" operator)
  trainer=$("$HACK/images.sh" trainer)
  # The bring-your-own examples' images, built from their Dockerfiles as a user would (thin archives:
  # after the trainer's, whose layers they use).
  script=$("$HACK/images.sh" example script)
  hf=$("$HACK/images.sh" example hf-trainer)
  log "images built or cached in $((SECONDS - t0))s: ${operator%% *} ${trainer%% *} ${script%% *} ${hf%% *}"
  t0=$SECONDS
  "$HACK/cluster.sh" load "${operator#* }" "${trainer#* }" "${script#* }" "${hf#* }"
  log "images imported into every real node in $((SECONDS - t0))s"
  # One replica: two cores run the whole cluster (the chart's default is 2, with peering).
  if ! "$BIN/helm" upgrade --install tetrad "$REPO/charts/tetrad" --kubeconfig "$("$HACK/cluster.sh" kubeconfig)" \
      -n "$NS" --create-namespace --set replicas=1 --wait --timeout 600s >&2; then
    kctl get pods -n "$NS" -o wide >&2 || true
    kctl describe pods -n "$NS" >&2 || true
    kctl logs -n "$NS" deploy/tetrad --tail 50 >&2 || true
    log "the operator did not become Available"
    exit 1
  fi
  log "operator Available: $(kctl get deploy -n "$NS" -o jsonpath='{.items[0].metadata.name}')"
}

demo() {
  local t0=$SECONDS
  TETRAD_NODE_TAINT=tetrad.dev/fake-node=true:NoSchedule "$HACK/cluster.sh" up --nodes 1 --real-nodes 2 >/dev/null
  install
  kctl delete ptj quickstart --ignore-not-found --wait >/dev/null
  kctl apply -f "$REPO/examples/quickstart.yaml"
  # kubectl itself in the background, not the kctl function: `kctl ... &` would fork a subshell, and
  # the trap would kill that, leaving its kubectl behind.
  "$BIN/kubectl" --kubeconfig "$("$HACK/cluster.sh" kubeconfig)" get ptj quickstart -w &
  WATCHER=$!  # global: the EXIT trap runs after demo's locals are gone
  trap 'kill "$WATCHER" 2>/dev/null || true' EXIT
  if ! kctl wait ptj/quickstart --for=jsonpath='{.status.phase}'=Succeeded --timeout "${TIMEOUT}s" >/dev/null; then
    kctl get ptj,pods -o wide >&2 || true
    kctl describe ptj quickstart >&2 || true
    kctl logs -n "$NS" deploy/tetrad --tail 100 >&2 || true
    log "quickstart did not succeed within ${TIMEOUT}s"
    exit 1
  fi
  sleep 1  # the watcher prints the last phase
  kctl get pods -l tetrad.dev/job-name=quickstart -o wide
  log "quickstart Succeeded; $((SECONDS - t0))s in all"
  log "KUBECONFIG=$("$HACK/cluster.sh" kubeconfig); take it down with: hack/e2e.sh down"
}

[[ $(id -u) == 0 ]] || { log "needs root (real nodes, image builds)"; exit 1; }
case ${1:-demo} in
  demo) demo ;;
  install) install ;;
  down) "$HACK/cluster.sh" down ;;
  *) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 2 ;;  # the header comment
esac
