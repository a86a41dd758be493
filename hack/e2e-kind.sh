#!/usr/bin/env bash
# The end-to-end path for machines with Docker (users' CI, .github/workflows/e2e.yaml):
# a kind cluster, both images built and loaded into it, the chart installed, the
# quickstart applied and awaited to Succeeded, status.training.tokensPerSecond > 0;
# logs dumped on failure, the cluster deleted at the end. Needs docker, kubectl,
# helm and go (to install the pinned kind). The development machines have no
# Docker: there `make e2e` (docs/e2e.md) runs real pods on real nodes instead.
#
# Environment: TETRAD_KIND_CLUSTER (default tetrad-e2e), TETRAD_E2E_TIMEOUT (default
# 1200s), TETRAD_KEEP_KIND=1 keeps the cluster, TETRAD_TORCH_INDEX (default: PyPI's
# CPU wheels index, so the trainer image is not the 4 GB CUDA build).
set -euo pipefail

KIND_VERSION=v0.33.0
# kind v0.33.0's default node image, by digest.
NODE_IMAGE=kindest/node:v1.37.0@sha256:a1ed56cfb0e7b93589bdf97c8cd566405a265939e3620fc4f5de89adff580ae5
CLUSTER=${TETRAD_KIND_CLUSTER:-tetrad-e2e}
TIMEOUT=${TETRAD_E2E_TIMEOUT:-1200s}
TORCH_INDEX=${TETRAD_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO/pyproject.toml" | head -1)
NS=tetrad-system

for tool in docker kubectl helm go; do
  command -v "$tool" >/dev/null || { echo "e2e-kind: $tool is required" >&2; exit 1; }
done
KIND=$(go env GOPATH)/bin/kind
if ! [[ -x $KIND && $("$KIND" version) == "kind $KIND_VERSION "* ]]; then
  go install "sigs.k8s.io/kind@$KIND_VERSION"
fi
cd "$REPO"

dump() {
  echo "::group::e2e-kind: state after the failure" >&2
  kubectl get ptj,pods,events -A -o wide >&2 || true
  kubectl describe ptj -A >&2 || true
  kubectl logs -n "$NS" -l app.kubernetes.io/instance=tetrad --all-containers --tail 300 --prefix >&2 || true
  kubectl logs -l tetrad.dev/job-name=quickstart --all-containers --tail 300 --prefix >&2 || true
  echo "::endgroup::" >&2
}
finish() {
  local rc=$?
  ((rc == 0)) || dump
  [[ ${TETRAD_KEEP_KIND:-} == 1 ]] || "$KIND" delete cluster --name "$CLUSTER" || true
  exit "$rc"
}
trap finish EXIT

"$KIND" create cluster --name "$CLUSTER" --image "$NODE_IMAGE" --wait 180s
docker build --target operator -t "tetrad/operator:$VERSION" .
docker build --target trainer --build-arg TORCH_INDEX="$TORCH_INDEX" -t "tetrad/trainer:$VERSION" .
"$KIND" load docker-image --name "$CLUSTER" "tetrad/operator:$VERSION" "tetrad/trainer:$VERSION"

helm install tetrad charts/tetrad -n "$NS" --create-namespace --wait --timeout 300s
kubectl apply -f examples/quickstart.yaml
kubectl get ptj quickstart -w &
watcher=$!
kubectl wait ptj/quickstart --for=jsonpath='{.status.phase}'=Succeeded --timeout "$TIMEOUT"
kill "$watcher" 2>/dev/null || true
tps=$(kubectl get ptj quickstart -o jsonpath='{.status.training.tokensPerSecond}')
if ! awk -v t="$tps" 'BEGIN { exit !(t + 0 > 0) }'; then
  echo "e2e-kind: status.training.tokensPerSecond is '$tps', expected > 0" >&2
  exit 1
fi
echo "e2e-kind: quickstart Succeeded at $tps tokens/s"
