# shellcheck shell=bash
# Gang schedulers for hack/cluster.sh (sourced by it): `scheduler NAME` starts
# one beside a running cluster, for the tests of Tetrad's gang backends; `down`
# stops whichever were started. Binaries come from hack/k8s-tools.sh, the CRDs
# from the pinned module's own manifests (hack/tools/<module>/go.mod); what they
# share with the other add-ons is in hack/cluster/addons.sh.
#
#   coscheduling   the scheduler-plugins scheduler (profile
#                  scheduler-plugins-scheduler: the default plugins and
#                  Coscheduling) and its PodGroup controller
#   kueue          the Kueue manager with its pod integration, its webhooks
#                  served on loopback (see up_kueue)
#
# They talk to the apiserver as a system:masters client of their own; on a
# real cluster they run with the RBAC of the upstream install manifests.

GANG_SCHEDULERS="coscheduling kueue"
declare -A GANG_COMPONENTS=(
  [coscheduling]="scheduler-plugins-scheduler scheduler-plugins-controller"
  [kueue]="kueue"
)

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
  local dir
  dir=$(module_dir scheduler-plugins sigs.k8s.io/scheduler-plugins)
  [[ -d $dir ]] || die "scheduler-plugins: its module source was not found"
  # The PodGroup CRD, and the ElasticQuota one its controller also watches.
  kctl apply --server-side --force-conflicts -f "$dir/manifests/coscheduling/crd.yaml" \
    -f "$dir/manifests/capacityscheduling/crd.yaml" >&2
  crds_established podgroups.scheduling.x-k8s.io elasticquotas.scheduling.x-k8s.io
  addon_port COSCHEDULING_SCHEDULER_PORT
  addon_port COSCHEDULING_CONTROLLER_PORT
  # shellcheck disable=SC2086  # a list of names
  launch_components 60 ${GANG_COMPONENTS[coscheduling]}
}

start_kueue() {
  cat > "$ETC/kueue.yaml" <<EOF
apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
namespace: kueue-system
health:
  healthProbeBindAddress: 127.0.0.1:$KUEUE_HEALTH_PORT
metrics:
  bindAddress: "0"
webhook:
  host: 127.0.0.1
  port: $KUEUE_WEBHOOK_PORT
  certDir: $STATE/kueue-certs
leaderElection:
  leaderElect: false
clientConnection:
  qps: 200
  burst: 400
integrations:
  frameworks:
  - pod
EOF
  start kueue --config "$ETC/kueue.yaml" --kubeconfig "$(addon_kubeconfig kueue)" \
    --visibility-server-port "$KUEUE_VISIBILITY_PORT"
}
healthy_kueue() { curl -sf "http://127.0.0.1:$KUEUE_HEALTH_PORT/readyz"; }

# The module's CRDs, with the conversion webhooks its kustomization patches in,
# and its webhook configurations for what runs here (pods and Kueue's own
# objects; the other integrations are off). Every webhook calls the manager on
# loopback; the pod webhooks see only pods that name a queue, so nobody else's
# pod waits for Kueue.
kueue_crds() {
  local converted crd
  converted=$(sed -n 's|^- path: patches/webhook_in_\(.*\)\.yaml$|\1.kueue.x-k8s.io|p' \
    "$1/config/components/crd/kustomization.yaml" | jq -R . | jq -s .)
  for crd in "$1"/config/components/crd/bases/kueue.x-k8s.io_*.yaml; do
    kctl create --dry-run=client -o json -f "$crd"
  done | jq --arg url "https://127.0.0.1:$KUEUE_WEBHOOK_PORT/convert" --argjson converted "$converted" '
    if (.metadata.name | IN($converted[])) then
      .spec.conversion = {strategy: "Webhook", webhook: {conversionReviewVersions: ["v1"], clientConfig: {url: $url}}}
    else . end'
}

kueue_webhooks() {
  webhooks_on_loopback kueue "$KUEUE_WEBHOOK_PORT" "" "$1/config/components/webhook/manifests.yaml" \
    kueue.x-k8s.io/queue-name | jq '.webhooks |= map(select(.rules | any(.apiGroups | index("") or index("kueue.x-k8s.io"))))'
}

up_kueue() {
  local dir
  dir=$(module_dir kueue sigs.k8s.io/kueue)
  [[ -d $dir ]] || die "kueue: its module source was not found"
  addon_port KUEUE_WEBHOOK_PORT
  addon_port KUEUE_HEALTH_PORT
  addon_port KUEUE_VISIBILITY_PORT
  kctl create namespace kueue-system --dry-run=client -o yaml | kctl apply -f - >&2
  rotator_secret kueue kueue-webhook-service.kueue-system.svc kueue-system kueue-webhook-server-cert "$STATE/kueue-certs"
  # Kueue puts its CA into the webhooks and the conversions once it is up.
  kueue_crds "$dir" | kctl apply --server-side --force-conflicts -f - >&2
  # shellcheck disable=SC2046  # one name per line
  crds_established $(kctl get crd -o name | sed -n 's|^.*/\(.*\.kueue\.x-k8s\.io\)$|\1|p')
  kueue_webhooks "$dir" | kctl apply --server-side --force-conflicts -f - >&2
  launch_components 90 "${GANG_COMPONENTS[kueue]}"
}

cmd_scheduler() { start_addon scheduler "$GANG_SCHEDULERS"; }
down_gang_schedulers() { stop_addons GANG_COMPONENTS "$GANG_SCHEDULERS"; }
