#!/usr/bin/env bash
# Build the pinned Kubernetes tools (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, kubelet, kube-proxy, etcd, kwok, kwokctl, helm, coredns, prometheus,
# actionlint, the scheduler-plugins scheduler and controller, kueue; on demand the
# benchmark's peers: training-operator, jobset, kubeflow-trainer) from Go
# modules into a cache outside the clone. Versions live only in the wrapper modules under
# hack/tools/; this script reads them from there.
#
#   hack/k8s-tools.sh [build]   build whatever is missing or stale (default)
#   hack/k8s-tools.sh check     exit 0 iff every tool is built at its pin
#   hack/k8s-tools.sh bindir    print the directory holding the binaries
#   hack/k8s-tools.sh versions  print tool, pinned version, stamp state
#
# Environment:
#   TETRAD_CACHE     cache root (default ${XDG_CACHE_HOME:-~/.cache}/tetrad, the same for
#                    `make test`, `.ci/run` and every script, so nothing is built twice)
#   TETRAD_GO_JOBS   go build -p (default 2; the builds are CPU-bound)
#   TETRAD_TOOLS     space-separated tools to build (default: all but the peers)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TOOLS_DIR=$REPO/hack/tools

CACHE=${TETRAD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tetrad}
BIN=$CACHE/bin

# tool -> "wrapper-module-dir main-package pinned-module"
declare -A SPEC=(
  [kube-apiserver]=". k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes"
  [kube-controller-manager]=". k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes"
  [kube-scheduler]=". k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes"
  [kubectl]=". k8s.io/kubernetes/cmd/kubectl k8s.io/kubernetes"
  [etcd]="etcd go.etcd.io/etcd/server/v3 go.etcd.io/etcd/server/v3"
  [kwok]="kwok sigs.k8s.io/kwok/cmd/kwok sigs.k8s.io/kwok"
  [kwokctl]="kwok sigs.k8s.io/kwok/cmd/kwokctl sigs.k8s.io/kwok"
  [helm]="helm helm.sh/helm/v4/cmd/helm helm.sh/helm/v4"
  [kubelet]=". k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes"
  [kube-proxy]=". k8s.io/kubernetes/cmd/kube-proxy k8s.io/kubernetes"
  [coredns]="coredns tetrad.dev/hack/tools/coredns github.com/coredns/coredns"
  [prometheus]="prometheus github.com/prometheus/prometheus/cmd/prometheus github.com/prometheus/prometheus"
  [actionlint]="actionlint github.com/rhysd/actionlint/cmd/actionlint github.com/rhysd/actionlint"
  [scheduler-plugins-scheduler]="scheduler-plugins sigs.k8s.io/scheduler-plugins/cmd/scheduler sigs.k8s.io/scheduler-plugins"
  [scheduler-plugins-controller]="scheduler-plugins sigs.k8s.io/scheduler-plugins/cmd/controller sigs.k8s.io/scheduler-plugins"
  [kueue]="kueue sigs.k8s.io/kueue/cmd/kueue sigs.k8s.io/kueue"
  [training-operator]="kubeflow github.com/kubeflow/training-operator/cmd/training-operator.v1 github.com/kubeflow/training-operator"
  [jobset]="kubeflow sigs.k8s.io/jobset sigs.k8s.io/jobset"
  [kubeflow-trainer]="kubeflow github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager github.com/kubeflow/trainer/v2"
)
ALL_TOOLS="etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok kwokctl helm kubelet kube-proxy coredns prometheus actionlint
  scheduler-plugins-scheduler scheduler-plugins-controller kueue"
# The operator benchmark's peers (hack/cluster.sh peer): built when named in TETRAD_TOOLS, never by default.
PEER_TOOLS="training-operator jobset kubeflow-trainer"
# Build tags per tool: Prometheus with its Kubernetes service discovery only (the others need cloud SDKs).
declare -A TAGS=(
  [prometheus]="remove_all_sd,enable_kubernetes_sd"
)

# Pinned version of module $2 in the wrapper module at $1 (plain go.mod read,
# so the warm path does not need the Go toolchain to load the module graph).
pinned_version() {
  awk -v m="$2" '($1 == "require" && $2 == m) { print $3; exit }
                 ($1 == m && $2 ~ /^v/) { print $2; exit }' "$1/go.mod"
}

# The stamp ties a binary to its pin and to its wrapper module (go.mod +
# go.sum): "VERSION modsum=HASH deps=HASH". When the module changes (a tool
# added beside it), the binary is relinked only if its own build graph
# changed: deps= hashes every module (path@version) its main package uses,
# and the Go version.
stamp_for() {
  local dir=$1 version=$2 tags=${3:-} sum
  sum=$(cat "$dir/go.mod" "$dir/go.sum" <(echo -n "${tags:+tags=$tags}") | sha256sum | cut -c1-16)
  echo "$version modsum=$sum"
}

deps_of() {
  local t=$1
  (cd "$(tool_dir "$t")" && { go env GOVERSION; go list -tags "${TAGS[$t]:-}" -deps -f \
    '{{with .Module}}{{.Path}}@{{.Version}}{{with .Replace}}={{.Path}}@{{.Version}}{{end}}{{end}}' \
    "$(tool_field "$t" 1)"; } | sort -u | sha256sum | cut -c1-16)
}

stamped_deps() {
  [[ ! -f $BIN/.stamp-$1 ]] || sed -n 's/.* deps=\([0-9a-f]*\).*/\1/p' "$BIN/.stamp-$1"
}

# Written to a temp name and renamed, so a concurrent reader never sees half a stamp.
write_stamp() {
  echo "$(stamp_for "$(tool_dir "$1")" "$(tool_version "$1")" "${TAGS[$1]:-}") deps=$(deps_of "$1")" > "$BIN/.stamp-$1.tmp"
  mv -f "$BIN/.stamp-$1.tmp" "$BIN/.stamp-$1"
}

tool_field() { local -a f; read -ra f <<< "${SPEC[$1]}"; echo "${f[$2]}"; }
tool_dir() { echo "$TOOLS_DIR/$(tool_field "$1" 0)"; }
tool_version() { pinned_version "$(tool_dir "$1")" "$(tool_field "$1" 2)"; }

is_fresh() {
  local t=$1 stamp
  [[ -x $BIN/$t && -f $BIN/.stamp-$t ]] || return 1
  stamp=$(cat "$BIN/.stamp-$t")
  [[ ${stamp% deps=*} == "$(stamp_for "$(tool_dir "$t")" "$(tool_version "$t")" "${TAGS[$t]:-}")" ]]
}

ldflags_for() {
  local t=$1 v
  v=$(tool_version "$t")
  local date; date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  case $t in
    kube-*|kubectl|kubelet)
      # The module zip carries no git metadata and the proxy gives no commit
      # hash, so gitCommit is left empty rather than invented.
      local major=${v#v}; major=${major%%.*}
      local minor=${v#v*.}; minor=${minor%%.*}
      local flags="-s -w" pkg
      for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        flags+=" -X $pkg.gitVersion=$v -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
        flags+=" -X $pkg.gitCommit= -X $pkg.gitTreeState=clean -X $pkg.buildDate=$date"
      done
      echo "$flags" ;;
    etcd) echo "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=module-$v" ;;
    kwok|kwokctl)
      local kv; kv=$(tool_version kube-apiserver)
      # Make kwokctl default to the Kubernetes version we actually built.
      echo "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${v#v} -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=${kv#v}" ;;
    helm) echo "-s -w -X helm.sh/helm/v4/internal/version.version=$v -X helm.sh/helm/v4/internal/version.gitTreeState=clean" ;;
    coredns) echo "-s -w -X github.com/coredns/coredns/coremain.GitCommit=module-$v" ;;
    prometheus)
      # Module v0.316.0 is Prometheus 3.16.0.
      local release=${v#v0.}
      echo "-s -w -X github.com/prometheus/common/version.Version=${release:0:1}.${release:1}" ;;
    actionlint) echo "-s -w -X github.com/rhysd/actionlint.version=$v" ;;
    # component-base's gitVersion is the Kubernetes version its emulation checks compare with:
    # left at the default of the v0.34 libraries, not set to the plugins' own v0.34.7.
    scheduler-plugins-*) echo "-s -w" ;;
    kueue) echo "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$v" ;;
    jobset) echo "-s -w -X sigs.k8s.io/jobset/pkg/version.GitVersion=$v" ;;
    training-operator|kubeflow-trainer) echo "-s -w" ;;
  esac
}

build() {
  local want=${TETRAD_TOOLS:-$ALL_TOOLS} t
  local -a stale=()
  local -a unhashed=()
  for t in $want; do
    [[ -n ${SPEC[$t]:-} ]] || { echo "unknown tool: $t" >&2; exit 2; }
    if ! is_fresh "$t"; then stale+=("$t")
    elif [[ -z $(stamped_deps "$t") ]]; then unhashed+=("$t")
    fi
  done
  if command -v go >/dev/null; then
    export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-buildvcs=false -mod=readonly"
    # Stamps from before deps= existed: add it once (a few seconds per tool).
    for t in "${unhashed[@]}"; do write_stamp "$t"; done
  fi
  if ((${#stale[@]} == 0)); then
    echo "k8s-tools: all up to date in $BIN"
    return 0
  fi
  command -v go >/dev/null || { echo "k8s-tools: go is required to build ${stale[*]}" >&2; exit 1; }
  command -v flock >/dev/null || { echo "k8s-tools: flock (util-linux) is required" >&2; exit 1; }
  mkdir -p "$BIN"
  # One builder at a time (parallel test workers may all ask); re-check after waiting.
  exec 9>"$BIN/.lock"
  if ! flock -n 9; then
    echo "k8s-tools: waiting for another build to finish ..."
    flock 9
    local -a still=()
    for t in "${stale[@]}"; do is_fresh "$t" || still+=("$t"); done
    ((${#still[@]})) || { echo "k8s-tools: all up to date in $BIN"; return 0; }
    stale=("${still[@]}")
  fi
  local jobs=${TETRAD_GO_JOBS:-2} start=$SECONDS
  for t in "${stale[@]}"; do
    local dir pkg t0=$SECONDS old
    dir=$(tool_dir "$t"); pkg=$(tool_field "$t" 1)
    old=$(stamped_deps "$t")
    if [[ -x $BIN/$t && -n $old && ${old} == "$(deps_of "$t")" &&
          $(cut -d' ' -f1 "$BIN/.stamp-$t") == "$(tool_version "$t")" ]]; then
      write_stamp "$t"
      echo "k8s-tools: $t $(tool_version "$t"): its build graph is unchanged, kept"
      continue
    fi
    echo "k8s-tools: building $t $(tool_version "$t") ..."
    rm -f "$BIN/.stamp-$t"
    # Build to a temp name and rename, so an interrupted build never looks done.
    (cd "$dir" && go build -p "$jobs" -trimpath -tags "${TAGS[$t]:-}" -ldflags "$(ldflags_for "$t")" -o "$BIN/.$t.tmp" "$pkg")
    mv -f "$BIN/.$t.tmp" "$BIN/$t"
    write_stamp "$t"
    echo "k8s-tools: built $t in $((SECONDS - t0))s"
  done
  echo "k8s-tools: done in $((SECONDS - start))s -> $BIN"
}

case ${1:-build} in
  build) build ;;
  check)
    for t in ${TETRAD_TOOLS:-$ALL_TOOLS}; do is_fresh "$t" || { echo "stale: $t" >&2; exit 1; }; done ;;
  bindir) echo "$BIN" ;;
  versions)
    for t in $ALL_TOOLS $PEER_TOOLS; do
      if is_fresh "$t"; then state=built; elif [[ -x $BIN/$t ]]; then state=stale; else state=missing; fi
      printf '%-24s %-10s %s\n' "$t" "$(tool_version "$t")" "$state"
    done ;;
  *) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 2 ;;  # the header comment
esac
