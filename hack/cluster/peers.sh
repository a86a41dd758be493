# shellcheck shell=bash
# The peers Tetrad's operator benchmark measures itself against, for
# hack/cluster.sh (sourced by it): `peer NAME` starts one beside a running
# cluster; `down` stops them. Binaries come from hack/k8s-tools.sh (the pins in
# hack/tools/kubeflow/go.mod), the CRDs and webhooks from each module's own
# manifests, every webhook served on loopback with the settings of the
# project's release manifests (helpers in hack/cluster/addons.sh).
#
#   kubeflow-v1       Kubeflow training-operator v1 (PyTorchJob only), its
#                     validating webhooks; it manages its certificates itself,
#                     from the Secret made here (see rotator_secret)
#   kubeflow-v1-tuned the same, tuned to 500 API requests/s (burst 1,000)
#                     instead of its default 20 (burst 30)
#   kubeflow-v1-coscheduling
#                     the same with its gang scheduling through scheduler-plugins
#                     (coscheduling, started with it): a PodGroup per job, pods
#                     for the scheduler-plugins-scheduler profile
#                     (the three take turns: one training-operator at a time)
#   jobset            JobSet, its webhooks (JobSets, and pods that belong to one)
#   kubeflow-trainer  Kubeflow Trainer v2 over JobSet (started with it), its
#                     webhooks, and the torch-distributed ClusterTrainingRuntime
#
# Like the gang schedulers they are system:masters clients of their own.

PEERS="kubeflow-v1 kubeflow-v1-tuned kubeflow-v1-coscheduling jobset kubeflow-trainer"
declare -A PEER_COMPONENTS=(
  [kubeflow-v1]="training-operator"
  [kubeflow-v1-tuned]="training-operator"
  [kubeflow-v1-coscheduling]="training-operator"
  [jobset]="jobset"
  [kubeflow-trainer]="kubeflow-trainer"
)

# ---------------------------------------------------------------- Kubeflow v1

start_training_operator() {
  # Its webhook server binds every address (the binary has no flag for it).
  KUBECONFIG=$(addon_kubeconfig training-operator) start training-operator \
    --enable-scheme=pytorchjob --metrics-bind-address 0 \
    --health-probe-bind-address "127.0.0.1:$KUBEFLOW_V1_HEALTH_PORT" \
    --webhook-server-port "$KUBEFLOW_V1_WEBHOOK_PORT" ${KUBEFLOW_V1_GANG:+--gang-scheduler-name "$KUBEFLOW_V1_GANG"} \
    ${KUBEFLOW_V1_TUNED:+--kube-api-qps 500 --kube-api-burst 1000}
}
healthy_training_operator() {
  curl -sf "http://127.0.0.1:$KUBEFLOW_V1_HEALTH_PORT/readyz" &&
    webhook_served "$KUBEFLOW_V1_WEBHOOK_PORT" /validate-kubeflow-org-v1-pytorchjob
}

up_kubeflow_v1() { kubeflow_v1 "" ""; }
up_kubeflow_v1_tuned() { kubeflow_v1 "" tuned; }
up_kubeflow_v1_coscheduling() {
  up_coscheduling
  kubeflow_v1 scheduler-plugins-scheduler ""
}

# kubeflow_v1 GANG_SCHEDULER TUNED: the training-operator, restarted when it
# runs with other settings (no gang scheduler: ""; its default rate limits: "").
kubeflow_v1() {
  KUBEFLOW_V1_GANG=$1 KUBEFLOW_V1_TUNED=$2
  local dir
  dir=$(module_dir kubeflow github.com/kubeflow/training-operator)
  [[ -d $dir ]] || die "kubeflow-v1: its module source was not found"
  addon_port KUBEFLOW_V1_WEBHOOK_PORT
  addon_port KUBEFLOW_V1_HEALTH_PORT
  kctl create namespace kubeflow --dry-run=client -o yaml | kctl apply -f - >&2
  # Its rotator's directory is fixed in the binary (no flag, and not below $TMPDIR).
  rotator_secret training-operator training-operator.kubeflow.svc kubeflow training-operator-webhook-cert \
    /tmp/k8s-webhook-server/serving-certs
  kctl apply --server-side --force-conflicts -f "$dir/manifests/base/crds/kubeflow.org_pytorchjobs.yaml" >&2
  crds_established pytorchjobs.kubeflow.org
  # Its rotator puts its CA into the configuration of this name.
  webhooks_on_loopback training-operator "$KUBEFLOW_V1_WEBHOOK_PORT" "" "$dir/manifests/base/webhook/manifests.yaml" |
    jq '.metadata.name = "validator.training-operator.kubeflow.org"
        | .webhooks |= map(select(.rules | any(.resources | index("pytorchjobs"))))' |
    kctl apply --server-side --force-conflicts -f - >&2
  if alive training-operator && [[ $(cat "$RUN/training-operator.settings" 2>/dev/null) != "$1 $2" ]]; then
    stop training-operator
  fi
  echo "$1 $2" > "$RUN/training-operator.settings"
  launch_components 90 training-operator
}

# ---------------------------------------------------------------- JobSet

start_jobset() {
  cat > "$ETC/jobset.yaml" <<EOF
apiVersion: config.jobset.x-k8s.io/v1alpha1
kind: Configuration
health:
  healthProbeBindAddress: 127.0.0.1:$JOBSET_HEALTH_PORT
metrics:
  bindAddress: "0"
webhook:
  host: 127.0.0.1
  port: $JOBSET_WEBHOOK_PORT
  certDir: $STATE/jobset-certs
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: false
EOF
  start jobset --config "$ETC/jobset.yaml" --kubeconfig "$(addon_kubeconfig jobset)"
}
healthy_jobset() {
  curl -sf "http://127.0.0.1:$JOBSET_HEALTH_PORT/readyz" &&
    webhook_served "$JOBSET_WEBHOOK_PORT" /validate-jobset-x-k8s-io-v1alpha2-jobset
}

up_jobset() {
  local dir
  dir=$(module_dir kubeflow sigs.k8s.io/jobset)
  [[ -d $dir ]] || die "jobset: its module source was not found"
  addon_port JOBSET_WEBHOOK_PORT
  addon_port JOBSET_HEALTH_PORT
  serving_cert jobset-webhook jobset-webhook-service.jobset-system.svc "$STATE/jobset-certs"
  # One served version: its conversion webhook is never called, and left out.
  kctl apply --server-side --force-conflicts -f "$dir/config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml" >&2
  crds_established jobsets.jobset.x-k8s.io
  webhooks_on_loopback jobset "$JOBSET_WEBHOOK_PORT" "$PKI/ca.crt" "$dir/config/components/webhook/manifests.yaml" \
    jobset.sigs.k8s.io/jobset-name | kctl apply --server-side --force-conflicts -f - >&2
  launch_components 90 "${PEER_COMPONENTS[jobset]}"
}

# ---------------------------------------------------------------- Kubeflow Trainer v2

start_kubeflow_trainer() {
  cat > "$ETC/kubeflow-trainer.yaml" <<EOF
apiVersion: config.trainer.kubeflow.org/v1alpha1
kind: Configuration
health:
  healthProbeBindAddress: 127.0.0.1:$KUBEFLOW_TRAINER_HEALTH_PORT
metrics:
  bindAddress: "0"
webhook:
  host: 127.0.0.1
  port: $KUBEFLOW_TRAINER_WEBHOOK_PORT
leaderElection:
  leaderElect: false
controller:
  groupKindConcurrency:
    TrainJob.trainer.kubeflow.org: 5
    TrainingRuntime.trainer.kubeflow.org: 1
    ClusterTrainingRuntime.trainer.kubeflow.org: 1
certManagement:
  enable: false
clientConnection:
  qps: 50
  burst: 100
EOF
  # Its webhook server reads its certificates from \$TMPDIR/k8s-webhook-server/serving-certs.
  TMPDIR=$STATE/kubeflow-trainer-tmp start kubeflow-trainer --config "$ETC/kubeflow-trainer.yaml" \
    --kubeconfig "$(addon_kubeconfig kubeflow-trainer)"
}
healthy_kubeflow_trainer() {
  curl -sf "http://127.0.0.1:$KUBEFLOW_TRAINER_HEALTH_PORT/readyz" &&
    webhook_served "$KUBEFLOW_TRAINER_WEBHOOK_PORT" /validate-trainer-kubeflow-org-v1alpha1-trainjob
}

up_kubeflow_trainer() {
  up_jobset
  local dir
  dir=$(module_dir kubeflow github.com/kubeflow/trainer/v2)
  [[ -d $dir ]] || die "kubeflow-trainer: its module source was not found"
  addon_port KUBEFLOW_TRAINER_WEBHOOK_PORT
  addon_port KUBEFLOW_TRAINER_HEALTH_PORT
  serving_cert kubeflow-trainer-webhook kubeflow-trainer-controller-manager.kubeflow-system.svc \
    "$STATE/kubeflow-trainer-tmp/k8s-webhook-server/serving-certs"
  kctl apply --server-side --force-conflicts -f "$dir/manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml" \
    -f "$dir/manifests/base/crds/trainer.kubeflow.org_trainingruntimes.yaml" \
    -f "$dir/manifests/base/crds/trainer.kubeflow.org_clustertrainingruntimes.yaml" >&2
  crds_established trainjobs.trainer.kubeflow.org trainingruntimes.trainer.kubeflow.org \
    clustertrainingruntimes.trainer.kubeflow.org
  webhooks_on_loopback kubeflow-trainer "$KUBEFLOW_TRAINER_WEBHOOK_PORT" "$PKI/ca.crt" \
    "$dir/manifests/base/webhook/manifests.yaml" | kctl apply --server-side --force-conflicts -f - >&2
  launch_components 90 "${PEER_COMPONENTS[kubeflow-trainer]}"
  kctl apply --server-side --force-conflicts -f "$dir/manifests/base/runtimes/torch_distributed.yaml" >&2
}

cmd_peer() { start_addon peer "$PEERS"; }
down_peers() { stop_addons PEER_COMPONENTS "$PEERS"; }
