# shellcheck shell=bash
# Gang schedulers for hack/cluster.sh (sourced by it): `scheduler NAME` starts
# one beside a running cluster, for the tests of Tetrad's gang backends; `down`
# stops whichever were started. Binaries come from hack/k8s-tools.sh, the CRDs
# from the pinned module's own manifests (hack/tools/<module>/go.mod).
#
#   coscheduling   the scheduler-plugins scheduler (profile
#                  scheduler-plugins-scheduler: the default plugins and
#                  Coscheduling) and its PodGroup controller
#
# Both talk to the apiserver as a system:masters client of their own; on a
# real cluster they run with the RBAC of the upstream install manifests.

GANG_SCHEDULERS="coscheduling"
GANG_COMPONENTS="scheduler-plugins-scheduler scheduler-plugins-controller"

# module_dir WRAPPER MODULE: the pinned module's source in the Go module cache
# (downloaded if missing; the binaries' build downloaded it already).
module_dir() {
  (cd "$HACK/tools/$1" && GOTOOLCHAIN=local GOFLAGS=-mod=mod go mod download -json "$2") |
    awk -F'"' '$2 == "Dir" { print $4 }'
}

# A client certificate and kubeconfig for an add-on component, made once.
addon_kubeconfig() {
  local kc=$STATE/$1.kubeconfig
  if [[ ! -f $kc ]]; then
    sign "$1" "/O=system:masters/CN=$1" 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth'
    write_kubeconfig "$kc" "$1"
  fi
  echo "$kc"
}

# addon_port VAR: a free port, kept in cluster.env so status and down find it.
addon_port() {
  local value
  value=$(sed -n "s/^$1=//p" "$STATE/cluster.env")
  if [[ -z $value ]]; then
    value=$(free_port)
    echo "$1=$value" >> "$STATE/cluster.env"
  fi
  printf -v "$1" '%s' "$value"
}

start_scheduler_plugins_scheduler() {
  local kc; kc=$(addon_kubeconfig scheduler-plugins)
  cat > "$ETC/scheduler-plugins.yaml" <<EOF
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: $kc
  qps: 200
  burst: 400
leaderElection:
  leaderElect: false
enableProfiling: false
profiles:
- schedulerName: scheduler-plugins-scheduler
  plugins:
    multiPoint:
      enabled:
      - name: Coscheduling
    queueSort:
      enabled:
      - name: Coscheduling
      disabled:
      - name: "*"
EOF
  start scheduler-plugins-scheduler --config "$ETC/scheduler-plugins.yaml" \
    --authentication-kubeconfig "$kc" --authorization-kubeconfig "$kc" \
    --bind-address 127.0.0.1 --secure-port "$COSCHEDULING_SCHEDULER_PORT"
}
healthy_scheduler_plugins_scheduler() { curl -sfk "https://127.0.0.1:$COSCHEDULING_SCHEDULER_PORT/healthz"; }

start_scheduler_plugins_controller() {
  KUBECONFIG=$(addon_kubeconfig scheduler-plugins) start scheduler-plugins-controller \
    --metricsAddr 0 --probeAddr "127.0.0.1:$COSCHEDULING_CONTROLLER_PORT" --qps 200 --burst 400 --workers 4
}
healthy_scheduler_plugins_controller() { curl -sf "http://127.0.0.1:$COSCHEDULING_CONTROLLER_PORT/healthz"; }

up_coscheduling() {
  TETRAD_TOOLS="$GANG_COMPONENTS" "$HACK/k8s-tools.sh" build >&2
  local dir
  dir=$(module_dir scheduler-plugins sigs.k8s.io/scheduler-plugins)
  [[ -d $dir ]] || die "scheduler-plugins: its module source was not found"
  # The PodGroup CRD, and the ElasticQuota one its controller also watches.
  kctl apply --server-side --force-conflicts -f "$dir/manifests/coscheduling/crd.yaml" \
    -f "$dir/manifests/capacityscheduling/crd.yaml" >&2
  kctl wait --for condition=Established --timeout 60s crd/podgroups.scheduling.x-k8s.io \
    crd/elasticquotas.scheduling.x-k8s.io >&2
  addon_port COSCHEDULING_SCHEDULER_PORT
  addon_port COSCHEDULING_CONTROLLER_PORT
  local c
  for c in $GANG_COMPONENTS; do
    alive "$c" || "start_${c//-/_}"
  done
  for c in $GANG_COMPONENTS; do await "$c" 60; done
}

cmd_scheduler() {
  [[ ${#ARCHIVES[@]} == 1 && " $GANG_SCHEDULERS " == *" ${ARCHIVES[0]} "* ]] ||
    die "scheduler: name one of: $GANG_SCHEDULERS"
  load_state || die "scheduler: cluster $NAME is not up"
  local t0=$SECONDS
  "up_${ARCHIVES[0]}"
  log "${ARCHIVES[0]} up in $((SECONDS - t0))s"
}

down_gang_schedulers() {
  local c
  for c in $GANG_COMPONENTS; do stop "$c"; done
}
