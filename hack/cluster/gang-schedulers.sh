# shellcheck shell=bash
# Gang schedulers for hack/cluster.sh (sourced by it): `scheduler NAME` starts
# one beside a running cluster, for the tests of Tetrad's gang backends; `down`
# stops whichever were started. Binaries come from hack/k8s-tools.sh, the CRDs
# from the pinned module's own manifests (hack/tools/<module>/go.mod).
#
#   coscheduling   the scheduler-plugins scheduler (profile
#                  scheduler-plugins-scheduler: the default plugins and
#                  Coscheduling) and its PodGroup controller
#   kueue          the Kueue manager with its pod integration, its webhooks
#                  served on loopback (see kueue_certs)
#
# They talk to the apiserver as a system:masters client of their own; on a
# real cluster they run with the RBAC of the upstream install manifests.

GANG_SCHEDULERS="coscheduling kueue"
declare -A GANG_COMPONENTS=(
  [coscheduling]="scheduler-plugins-scheduler scheduler-plugins-controller"
  [kueue]="kueue"
)

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
    sign "$1" "/O=system:masters/CN=$1" "$CLIENT_CERT"
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
  TETRAD_TOOLS="${GANG_COMPONENTS[coscheduling]}" "$HACK/k8s-tools.sh" build >&2
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
  launch_components coscheduling 60
}

# launch_components SCHEDULER SECONDS: start its components not running yet, then await them all.
launch_components() {
  local c
  for c in ${GANG_COMPONENTS[$1]}; do
    alive "$c" || "start_${c//-/_}"
  done
  for c in ${GANG_COMPONENTS[$1]}; do await "$c" "$2"; done
}

# Kueue's own certificate management (internalCertManagement, as its release
# manifests run it) keeps the certificates of the Secret it finds when they are
# valid for its Service name: this one is, and for 127.0.0.1 too, where the
# apiserver calls the webhooks here. A CA of its own (Kueue's Secret holds the
# CA key), named kueue-ca as Kueue checks, with the PKCS#1 RSA key it parses.
kueue_certs() {
  [[ -f $PKI/kueue-ca.crt ]] || {
    openssl genrsa -traditional -out "$PKI/kueue-ca.key" 2048 2>/dev/null
    openssl req -x509 -new -key "$PKI/kueue-ca.key" -subj "/O=kueue/CN=kueue-ca" -days 3650 \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,digitalSignature,keyEncipherment" \
      -addext "subjectAltName=DNS:kueue-ca" -out "$PKI/kueue-ca.crt" 2>/dev/null
    sign kueue-webhook "/CN=kueue-webhook-service.kueue-system.svc" "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=DNS:kueue-webhook-service.kueue-system.svc,IP:127.0.0.1" kueue-ca
  }
  kctl create secret generic kueue-webhook-server-cert -n kueue-system --dry-run=client -o yaml \
    --from-file ca.crt="$PKI/kueue-ca.crt" --from-file ca.key="$PKI/kueue-ca.key" \
    --from-file tls.crt="$PKI/kueue-webhook.crt" --from-file tls.key="$PKI/kueue-webhook.key" | kctl apply -f - >&2
  # Where its pod would mount that Secret.
  mkdir -p "$STATE/kueue-certs"
  cp "$PKI/kueue-webhook.crt" "$STATE/kueue-certs/tls.crt"
  cp "$PKI/kueue-webhook.key" "$STATE/kueue-certs/tls.key"
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
  kctl create --dry-run=client -o json -f "$1/config/components/webhook/manifests.yaml" |
    jq --arg url "https://127.0.0.1:$KUEUE_WEBHOOK_PORT" '
      .metadata.name = "kueue-" + .metadata.name
      | .webhooks |= map(select(.rules | any(.apiGroups | index("") or index("kueue.x-k8s.io")))
        | .clientConfig = {url: ($url + .clientConfig.service.path)}
        | if (.rules | any(.resources | index("pods"))) then
            .objectSelector = {matchExpressions: [{key: "kueue.x-k8s.io/queue-name", operator: "Exists"}]}
          else . end)'
}

up_kueue() {
  TETRAD_TOOLS="${GANG_COMPONENTS[kueue]}" "$HACK/k8s-tools.sh" build >&2
  local dir
  dir=$(module_dir kueue sigs.k8s.io/kueue)
  [[ -d $dir ]] || die "kueue: its module source was not found"
  addon_port KUEUE_WEBHOOK_PORT
  addon_port KUEUE_HEALTH_PORT
  addon_port KUEUE_VISIBILITY_PORT
  kctl create namespace kueue-system --dry-run=client -o yaml | kctl apply -f - >&2
  kueue_certs
  # Kueue puts its CA into the webhooks and the conversions once it is up.
  kueue_crds "$dir" | kctl apply --server-side --force-conflicts -f - >&2
  kctl wait --for condition=Established --timeout 60s crd -l '!tetrad.dev/none' >&2
  kueue_webhooks "$dir" | kctl apply --server-side --force-conflicts -f - >&2
  launch_components kueue 90
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
  local s c
  for s in $GANG_SCHEDULERS; do
    for c in ${GANG_COMPONENTS[$s]}; do stop "$c"; done
  done
}
