#!/usr/bin/env bash
# A real local Kubernetes control plane for tests: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler and a kwok controller that plays
# the kubelet for fake GPU nodes; optionally real nodes beside them (a kubelet
# and a containerd each, CNI bridges, CoreDNS; root only, see
# hack/cluster/real-nodes.sh). Binaries come from hack/k8s-tools.sh; the
# control plane listens on loopback only; state lives in one directory.
#
#   hack/cluster.sh up [--name N] [--nodes N] [--gpus-per-node G] [--real-nodes R]
#   hack/cluster.sh down [--name N]
#   hack/cluster.sh status [--name N]
#   hack/cluster.sh kubeconfig [--name N]   print the admin kubeconfig path
#   hack/cluster.sh env [--name N]          print the cluster's env file path
#   hack/cluster.sh load [--name N] ARCHIVE...  import OCI image archives into every
#                                           real node's containerd (as `kind load`), in
#                                           order (a thin archive after its base's)
#   hack/cluster.sh scheduler [--name N] coscheduling|kueue
#                                           start a gang scheduler beside the cluster
#                                           (hack/cluster/gang-schedulers.sh); down stops it
#   hack/cluster.sh peer [--name N] kubeflow-v1|kubeflow-v1-tuned|kubeflow-v1-coscheduling|jobset|kubeflow-trainer
#                                           start a peer of the operator benchmark beside
#                                           the cluster (hack/cluster/peers.sh); down stops it
#
# Environment (flags win):
#   TETRAD_CLUSTER_NAME    instance name (default: tetrad); one state dir each
#   TETRAD_NODES           fake nodes (default 4)
#   TETRAD_REAL_NODES      real nodes (default 0)
#   TETRAD_GPUS_PER_NODE   nvidia.com/gpu per node (default 8)
#   TETRAD_NODE_CPU / TETRAD_NODE_MEMORY / TETRAD_NODE_PODS
#                          per-node capacity (default 96 / 1536Gi / 110)
#   TETRAD_NODES_PER_NVLINK  nodes sharing one NVLink domain (default 1)
#   TETRAD_NODES_PER_RACK    nodes per rack (default 2)
#   TETRAD_RACKS_PER_ZONE    racks per zone (default 2)
#   TETRAD_GPU_PRODUCT     nvidia.com/gpu.product label (default NVIDIA-H100-80GB-HBM3)
#   TETRAD_NODE_TAINT      optional taint on every node, e.g. nvidia.com/gpu=present:NoSchedule
#   TETRAD_APISERVER_PORT  fixed apiserver port (default: a free one)
#   TETRAD_WORKLOAD_SCHEDULING  1 (default): the alpha Workload-Aware Scheduling
#                          gates (GenericWorkload, GangScheduling,
#                          TopologyAwareWorkloadScheduling) and scheduling.k8s.io/v1alpha2
#                          on the apiserver, controller-manager and scheduler; 0: off
#   TETRAD_{APISERVER,CONTROLLER_MANAGER,SCHEDULER,KWOK,ETCD}_ARGS
#                          extra flags appended to that component
#   TETRAD_CACHE           cache root (see hack/k8s-tools.sh)
set -euo pipefail

HACK=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BIN=$("$HACK/k8s-tools.sh" bindir)
CACHE=$(dirname "$BIN")

NAME=${TETRAD_CLUSTER_NAME:-tetrad}
NODES=${TETRAD_NODES:-4}
REAL_NODES=${TETRAD_REAL_NODES:-0}
GPUS=${TETRAD_GPUS_PER_NODE:-8}
NODE_CPU=${TETRAD_NODE_CPU:-96}
NODE_MEMORY=${TETRAD_NODE_MEMORY:-1536Gi}
NODE_PODS=${TETRAD_NODE_PODS:-110}
PER_NVLINK=${TETRAD_NODES_PER_NVLINK:-1}
PER_RACK=${TETRAD_NODES_PER_RACK:-2}
RACKS_PER_ZONE=${TETRAD_RACKS_PER_ZONE:-2}
GPU_PRODUCT=${TETRAD_GPU_PRODUCT:-NVIDIA-H100-80GB-HBM3}
NODE_TAINT=${TETRAD_NODE_TAINT:-}
SERVICE_CIDR=198.19.0.0/16   # the kubernetes Service is its .1
COMPONENTS="etcd kube-apiserver kube-controller-manager kube-scheduler kwok"
# Alpha in 1.36; they only act on pods that name a PodGroup (spec.schedulingGroup).
WORKLOAD_GATES=() WORKLOAD_API=()
if [[ ${TETRAD_WORKLOAD_SCHEDULING:-1} == 1 ]]; then
  # shellcheck disable=SC2054  # one flag value, commas and all
  WORKLOAD_GATES=(--feature-gates GenericWorkload=true,GangScheduling=true,TopologyAwareWorkloadScheduling=true)
  WORKLOAD_API=(--runtime-config scheduling.k8s.io/v1alpha2=true)
fi

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 2; }  # the header comment

CMD=${1:-}; [[ -n $CMD ]] || usage; shift
ARCHIVES=()
while (($#)); do
  case $1 in
    --name) NAME=$2; shift 2 ;;
    --nodes) NODES=$2; shift 2 ;;
    --gpus-per-node) GPUS=$2; shift 2 ;;
    --real-nodes) REAL_NODES=$2; shift 2 ;;
    -h|--help) usage ;;
    -*) echo "unknown argument: $1" >&2; usage ;;
    *) [[ $CMD == load || $CMD == scheduler || $CMD == peer ]] || { echo "unknown argument: $1" >&2; usage; }; ARCHIVES+=("$1"); shift ;;
  esac
done
[[ $NAME =~ ^[a-zA-Z0-9_.-]+$ ]] || { echo "bad cluster name: $NAME" >&2; exit 2; }
[[ $NODES =~ ^[0-9]+$ && $REAL_NODES =~ ^[0-9]+$ ]] || { echo "--nodes and --real-nodes take a count" >&2; exit 2; }
((NODES <= 1024)) || { echo "--nodes: at most 1024 (the fake nodes' addresses fill 198.18.16.0-198.18.191.255)" >&2; exit 2; }

for tool in openssl curl awk setsid base64 xargs; do
  command -v "$tool" >/dev/null || { echo "cluster.sh needs $tool" >&2; exit 1; }
done

STATE=$CACHE/clusters/$NAME
PKI=$STATE/pki RUN=$STATE/run LOGS=$STATE/logs ETC=$STATE/etc

log() { echo "cluster[$NAME]: $*" >&2; }
die() { log "error: $*"; exit 1; }

# shellcheck source=hack/cluster/real-nodes.sh
source "$HACK/cluster/real-nodes.sh"
# shellcheck source=hack/cluster/addons.sh
source "$HACK/cluster/addons.sh"
# shellcheck source=hack/cluster/gang-schedulers.sh
source "$HACK/cluster/gang-schedulers.sh"
# shellcheck source=hack/cluster/peers.sh
source "$HACK/cluster/peers.sh"

# The control plane listens on loopback; with real nodes the apiserver listens
# where their pods reach it instead (the services bridge, see real-nodes.sh) and
# is the endpoint of the "kubernetes" Service.
if ((REAL_NODES > 0)); then
  APISERVER_IP=$REAL_APISERVER_IP ENDPOINT_RECONCILER=lease
else
  APISERVER_IP=127.0.0.1 ENDPOINT_RECONCILER=none
fi

# ---------------------------------------------------------------- processes

# Listening TCP ports (decimal), from /proc so no extra tools are needed.
listening_ports() {
  local hex
  awk '$4 == "0A" { split($2, a, ":"); print a[2] }' /proc/net/tcp /proc/net/tcp6 2>/dev/null |
    while read -r hex; do echo $((16#$hex)); done
}

free_port() {
  local used p _
  used=" $(listening_ports | tr '\n' ' ') $* "
  for _ in $(seq 1 200); do
    p=$((20000 + RANDOM % 12000))   # below the usual ephemeral range
    [[ $used == *" $p "* ]] || { echo "$p"; return; }
  done
  die "no free port found"
}

# /proc/PID/stat fields after "pid (comm) ": 1 state, 3 pgrp, 20 starttime.
stat_field() {
  local line rest
  { read -r line < "/proc/$1/stat"; } 2>/dev/null || return 1
  rest=${line##*) }
  awk -v n="$2" '{ print $n }' <<< "$rest"
}

# A pid file holds "pid starttime" so a recycled pid is never mistaken for ours.
proc_start() { stat_field "$1" 20; }

# Live (non-zombie) members of process group $1. Zombies count as gone: the
# init process of a container does not always reap orphans promptly.
group_alive() {
  local f line rest
  local -a a
  for f in /proc/[0-9]*/stat; do
    { read -r line < "$f"; } 2>/dev/null || continue
    rest=${line##*) }
    read -ra a <<< "$rest"
    [[ ${a[2]} == "$1" && ${a[0]} != Z ]] && return 0
  done
  return 1
}

alive() {
  local f=$RUN/$1.pid pid start
  [[ -f $f ]] || return 1
  read -r pid start < "$f"
  [[ -n $pid && $(proc_start "$pid") == "$start" && $(stat_field "$pid" 1) != Z ]]
}

# start NAME ARGS...: run a binary from $BIN in its own session (so its whole
# process group can be signalled), logging to $LOGS/NAME.log.
start() {
  local name=$1; shift
  setsid "$BIN/$name" "$@" </dev/null >"$LOGS/$name.log" 2>&1 &
  local pid=$!
  echo "$pid $(proc_start "$pid")" > "$RUN/$name.pid"
}

stop() {
  local name=$1 f=$RUN/$1.pid pid start _
  [[ -f $f ]] || return 0
  read -r pid start < "$f"
  if [[ -n $pid && $(proc_start "$pid") == "$start" ]]; then
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do group_alive "$pid" || break; sleep 0.1; done
    if group_alive "$pid"; then
      log "$name did not exit on SIGTERM within 10s, killing"
      kill -KILL -- "-$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do group_alive "$pid" || break; sleep 0.1; done
    fi
    group_alive "$pid" && die "$name (process group $pid) still running"
  fi
  rm -f "$f"
}

# must_wait COMPONENT DESC SECONDS CMD...: poll until CMD succeeds; fail fast
# with the component's log tail if it exits or the time runs out.
must_wait() {
  local comp=$1 desc=$2 limit=$3 t0=$SECONDS; shift 3
  until "$@" >/dev/null 2>&1; do
    if ! alive "$comp"; then
      log "$comp exited while waiting for $desc"
    elif ((SECONDS - t0 >= limit)); then
      log "timed out after ${limit}s waiting for $desc"
    else
      sleep 0.2; continue
    fi
    log "last lines of $LOGS/$comp.log:"
    tail -n 30 "$LOGS/$comp.log" >&2 || true
    exit 1
  done
}

# ---------------------------------------------------------------- pki

# The extensions of every client certificate (control plane, nodes, add-ons).
CLIENT_CERT='basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth'

# EC keys: quick to generate, accepted by every component.
gen_key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

new_ca() {
  gen_key "$PKI/$1.key"
  openssl req -x509 -new -key "$PKI/$1.key" -subj "/CN=$2" -days 3650 \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$PKI/$1.crt" 2>/dev/null
}

# sign NAME SUBJECT EXTENSIONS [CA]: key + cert signed by the local CA.
sign() {
  local name=$1 subj=$2 ext=$3 ca=${4:-ca}
  gen_key "$PKI/$name.key"
  openssl req -new -key "$PKI/$name.key" -subj "$subj" -out "$PKI/$name.csr" 2>/dev/null
  printf '%b\n' "$ext" > "$PKI/$name.ext"
  openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/$ca.crt" -CAkey "$PKI/$ca.key" -CAcreateserial \
    -days 3650 -extfile "$PKI/$name.ext" -out "$PKI/$name.crt" 2>/dev/null
  rm -f "$PKI/$name.csr" "$PKI/$name.ext"
}

gen_pki() {
  mkdir -p "$PKI"
  new_ca ca "tetrad-local-ca-$NAME"
  # Separate CA for the aggregation layer (front proxy), as kubeadm does.
  new_ca front-proxy-ca "tetrad-front-proxy-ca-$NAME"
  sign apiserver "/CN=kube-apiserver" "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:$APISERVER_IP,IP:127.0.0.1,IP:198.19.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  sign admin "/O=system:masters/CN=tetrad-admin" "$CLIENT_CERT"
  sign kube-controller-manager "/CN=system:kube-controller-manager" "$CLIENT_CERT"
  sign kube-scheduler "/CN=system:kube-scheduler" "$CLIENT_CERT"
  sign kwok "/O=system:masters/CN=kwok-controller" "$CLIENT_CERT"
  # The apiserver's identity towards real kubelets (logs, exec, port-forward).
  sign apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "$CLIENT_CERT"
  sign front-proxy-client "/CN=front-proxy-client" "$CLIENT_CERT" front-proxy-ca
  gen_key "$PKI/sa.key"
  openssl pkey -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
  chmod 600 "$PKI"/*.key
}

# write_kubeconfig FILE USER: certificates embedded so the file is self-contained.
write_kubeconfig() {
  local b64='base64 -w0'
  cat > "$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: $NAME
  cluster:
    server: $APISERVER_URL
    certificate-authority-data: $($b64 < "$PKI/ca.crt")
users:
- name: $2
  user:
    client-certificate-data: $($b64 < "$PKI/$2.crt")
    client-key-data: $($b64 < "$PKI/$2.key")
contexts:
- name: $NAME
  context: {cluster: $NAME, user: $2, namespace: default}
current-context: $NAME
EOF
  chmod 600 "$1"
}

# ---------------------------------------------------------------- kwok config

write_kwok_config() {
  local kube_version kwok_version
  kube_version=$("$BIN/kube-apiserver" --version | awk '{ print $2 }')
  kwok_version=$("$BIN/kwok" --version 2>/dev/null | awk '{ print $3 }')
  sed -e "s/@KUBE_VERSION@/$kube_version/" -e "s/@KWOK_VERSION@/$kwok_version/" \
    "$HACK/cluster/kwok.yaml" > "$ETC/kwok.yaml"
}

# ---------------------------------------------------------------- nodes

# One Node object per fake GPU machine, generated by a single awk process
# (1024 nodes in well under a second). Addresses are made up but stay inside the
# 198.18.0.0/15 benchmark range, clear of the real nodes (198.18.0-15.x), CoreDNS
# (198.18.255.53) and the Services (198.19.0.0/16): node i gets InternalIP
# 198.18.(16+i/256).(i%256) and pod CIDR 198.18.(64+i).0/24 (up to 32 nodes) or
# 198.18.(64+i/8).(32*(i%8))/27 (up to 1024);
# rack, zone and NVLink domain are derived from i.
write_nodes() {
  awk -v n="$NODES" -v gpus="$GPUS" -v cpu="$NODE_CPU" -v mem="$NODE_MEMORY" -v pods="$NODE_PODS" \
      -v per_rack="$PER_RACK" -v racks_per_zone="$RACKS_PER_ZONE" -v per_nvl="$PER_NVLINK" \
      -v product="$GPU_PRODUCT" -v taint="$NODE_TAINT" 'BEGIN {
    if (taint != "") {  # key=value:Effect
      split(taint, kv, "="); split(kv[2], ve, ":")
      taint_yaml = sprintf("  taints:\n  - {key: %s, value: \"%s\", effect: %s}\n", kv[1], ve[1], ve[2])
    }
    res = sprintf("{cpu: \"%s\", memory: %s, pods: \"%s\", nvidia.com/gpu: \"%s\", ephemeral-storage: 8Ti}", cpu, mem, pods, gpus)
    for (i = 0; i < n; i++) {
      name = sprintf("gpu-node-%04d", i)
      rack = int(i / per_rack); zone = int(rack / racks_per_zone); nvl = int(i / per_nvl)
      # Up to 32 nodes get a /24 each (room for every pod of a long test session), more a /27.
      cidr = n <= 32 ? sprintf("198.18.%d.0/24", 64 + i) : sprintf("198.18.%d.%d/27", 64 + int(i / 8), 32 * (i % 8))
      printf "---\napiVersion: v1\nkind: Node\nmetadata:\n  name: %s\n", name
      printf "  annotations:\n    kwok.x-k8s.io/node: fake\n    node.alpha.kubernetes.io/ttl: \"0\"\n"
      printf "  labels:\n    kubernetes.io/hostname: %s\n    kubernetes.io/os: linux\n    kubernetes.io/arch: amd64\n", name
      printf "    type: kwok\n    node.kubernetes.io/instance-type: fake-gpu-%dx\n", gpus
      printf "    topology.kubernetes.io/region: local\n    topology.kubernetes.io/zone: zone-%d\n", zone
      printf "    tetrad.dev/rack: rack-%03d\n    tetrad.dev/fake-gpu-node: \"true\"\n", rack
      printf "    nvidia.com/nvlink-domain: nvl-%04d\n    nvidia.com/gpu.present: \"true\"\n", nvl
      printf "    nvidia.com/gpu.count: \"%s\"\n    nvidia.com/gpu.product: %s\n", gpus, product
      printf "spec:\n  podCIDR: %s\n  podCIDRs: [%s]\n%s", cidr, cidr, taint_yaml
      printf "status:\n  addresses:\n  - {type: InternalIP, address: 198.18.%d.%d}\n", 16 + int(i / 256), i % 256
      printf "  - {type: Hostname, address: %s}\n  capacity: %s\n  allocatable: %s\n", name, res, res
    }
  }' > "$ETC/nodes.yaml"
}

# Create the nodes with a few kubectl processes in parallel (one at a time is
# slow for a thousand nodes), then wait until kwok has made them all Ready.
create_fake_nodes() {
  ((NODES > 0)) || return 0
  write_nodes
  local chunk=$(( (NODES + 7) / 8 ))
  ((chunk >= 32)) || chunk=32
  rm -rf "$ETC/nodes.d"; mkdir -p "$ETC/nodes.d"
  awk -v per="$chunk" -v dir="$ETC/nodes.d" '
    /^---$/ { if (k++ % per == 0) { close(f); f = sprintf("%s/%04d.yaml", dir, k / per) } }
    { print > f }' "$ETC/nodes.yaml"
  printf '%s\0' "$ETC"/nodes.d/*.yaml |
    xargs -0 -n1 -P4 "$BIN/kubectl" --kubeconfig "$STATE/kubeconfig" create -o name -f >/dev/null
  must_wait kwok "$NODES nodes Ready" $((60 + NODES / 4)) fake_nodes_ready
}

kctl() { "$BIN/kubectl" --kubeconfig "$STATE/kubeconfig" "$@"; }

ready_nodes() {
  kctl get nodes -l tetrad.dev/fake-gpu-node=true --no-headers \
    -o custom-columns='R:.status.conditions[?(@.type=="Ready")].status' 2>/dev/null | grep -c '^True$' || true
}
fake_nodes_ready() { [[ $(ready_nodes) -ge $NODES ]]; }

# ---------------------------------------------------------------- components
# Each component has start_<name> (launch it in the background) and
# healthy_<name> (one probe). `launch` starts one and waits for its probe;
# the apiserver's three clients start together and are awaited afterwards.
# Ports come from cluster.env (ETCD_PORT, APISERVER_PORT, ...).

start_etcd() {
  # shellcheck disable=SC2086  # the *_ARGS variables are word lists on purpose
  start etcd --name "$NAME" --data-dir "$STATE/data/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "$NAME=http://127.0.0.1:$ETCD_PEER_PORT" \
    --unsafe-no-fsync --quota-backend-bytes 8589934592 --log-level warn ${TETRAD_ETCD_ARGS:-}
}
healthy_etcd() { curl -sf "http://127.0.0.1:$ETCD_PORT/health"; }

# On loopback endpoint reconciling is off: the "kubernetes" Service cannot
# point at a loopback address; with real nodes the apiserver leases it the
# services-bridge address, which kube-proxy serves. Services take addresses
# from 198.19.0.0/16, inside the 198.18.0.0/15 benchmark range like every
# address of the cluster, so no packet to a Service is ever addressed outside
# it. `kubectl logs/exec` reach a real node's kubelet at its InternalIP.
start_kube_apiserver() {
  # shellcheck disable=SC2086
  start kube-apiserver --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address "$APISERVER_IP" --advertise-address "$APISERVER_IP" --secure-port "$APISERVER_PORT" \
    --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
    --client-ca-file "$PKI/ca.crt" --authorization-mode RBAC \
    --kubelet-preferred-address-types InternalIP \
    --kubelet-client-certificate "$PKI/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$PKI/apiserver-kubelet-client.key" \
    --requestheader-client-ca-file "$PKI/front-proxy-ca.crt" --requestheader-allowed-names front-proxy-client \
    --requestheader-username-headers X-Remote-User --requestheader-group-headers X-Remote-Group \
    --requestheader-extra-headers-prefix X-Remote-Extra- \
    --proxy-client-cert-file "$PKI/front-proxy-client.crt" --proxy-client-key-file "$PKI/front-proxy-client.key" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
    --service-cluster-ip-range "$SERVICE_CIDR" --allow-privileged \
    --max-requests-inflight 800 --max-mutating-requests-inflight 400 \
    --profiling=false --endpoint-reconciler-type "$ENDPOINT_RECONCILER" "${WORKLOAD_GATES[@]}" "${WORKLOAD_API[@]}" \
    ${TETRAD_APISERVER_ARGS:-}
}
healthy_kube_apiserver() {
  curl -sf --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" "$APISERVER_URL/readyz"
}

start_kube_controller_manager() {
  local kc=$STATE/kube-controller-manager.kubeconfig
  # shellcheck disable=SC2086
  start kube-controller-manager --kubeconfig "$kc" \
    --authentication-kubeconfig "$kc" --authorization-kubeconfig "$kc" \
    --bind-address 127.0.0.1 --secure-port "$CONTROLLER_MANAGER_PORT" --leader-elect=false \
    --use-service-account-credentials --service-account-private-key-file "$PKI/sa.key" \
    --root-ca-file "$PKI/ca.crt" --cluster-signing-cert-file "$PKI/ca.crt" \
    --cluster-signing-key-file "$PKI/ca.key" --kube-api-qps 200 --kube-api-burst 400 \
    --profiling=false "${WORKLOAD_GATES[@]}" ${TETRAD_CONTROLLER_MANAGER_ARGS:-}
}
healthy_kube_controller_manager() { curl -sfk "https://127.0.0.1:$CONTROLLER_MANAGER_PORT/healthz"; }

start_kube_scheduler() {
  cat > "$ETC/kube-scheduler.yaml" <<EOF
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: $STATE/kube-scheduler.kubeconfig
  qps: 200
  burst: 400
leaderElection:
  leaderElect: false
enableProfiling: false
EOF
  # shellcheck disable=SC2086
  start kube-scheduler --config "$ETC/kube-scheduler.yaml" \
    --authentication-kubeconfig "$STATE/kube-scheduler.kubeconfig" \
    --authorization-kubeconfig "$STATE/kube-scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$SCHEDULER_PORT" "${WORKLOAD_GATES[@]}" ${TETRAD_SCHEDULER_ARGS:-}
}
healthy_kube_scheduler() { curl -sfk "https://127.0.0.1:$SCHEDULER_PORT/healthz"; }

start_kwok() {
  write_kwok_config
  mkdir -p "$STATE/kwok-home"
  # shellcheck disable=SC2086
  HOME=$STATE/kwok-home start kwok --kubeconfig "$STATE/kwok.kubeconfig" --config "$ETC/kwok.yaml" \
    --manage-nodes-with-annotation-selector kwok.x-k8s.io/node=fake \
    --server-address "127.0.0.1:$KWOK_PORT" ${TETRAD_KWOK_ARGS:-}
}
healthy_kwok() { curl -sf "http://127.0.0.1:$KWOK_PORT/healthz"; }

await() { must_wait "$1" "$1 to be healthy" "$2" "healthy_${1//-/_}"; }
launch() { "start_${1//-/_}"; await "$1" "$2"; }

# ---------------------------------------------------------------- state

# A fresh state dir: PKI, ports, cluster.env, one kubeconfig per client.
prepare_state() {
  rm -rf "$STATE"
  mkdir -p "$RUN" "$LOGS" "$ETC" "$STATE/data"
  gen_pki
  local -a taken=()
  local var
  for var in ETCD_PORT ETCD_PEER_PORT APISERVER_PORT CONTROLLER_MANAGER_PORT SCHEDULER_PORT KWOK_PORT; do
    if [[ $var == APISERVER_PORT && -n ${TETRAD_APISERVER_PORT:-} ]]; then
      printf -v "$var" '%s' "$TETRAD_APISERVER_PORT"
    else
      printf -v "$var" '%s' "$(free_port "${taken[@]}")"
    fi
    taken+=("${!var}")
  done
  APISERVER_URL=https://$APISERVER_IP:$APISERVER_PORT
  cat > "$STATE/cluster.env" <<EOF
TETRAD_CLUSTER_NAME=$NAME
TETRAD_CLUSTER_STATE=$STATE
KUBECONFIG=$STATE/kubeconfig
APISERVER_URL=$APISERVER_URL
ETCD_PORT=$ETCD_PORT
ETCD_PEER_PORT=$ETCD_PEER_PORT
APISERVER_PORT=$APISERVER_PORT
CONTROLLER_MANAGER_PORT=$CONTROLLER_MANAGER_PORT
SCHEDULER_PORT=$SCHEDULER_PORT
KWOK_PORT=$KWOK_PORT
SERVICE_CIDR=$SERVICE_CIDR
NODES=$NODES
GPUS_PER_NODE=$GPUS
EOF
  local c
  for c in admin kube-controller-manager kube-scheduler kwok; do
    write_kubeconfig "$STATE/$c.kubeconfig" "$c"
  done
  mv "$STATE/admin.kubeconfig" "$STATE/kubeconfig"
}

# Read an existing cluster's ports, URL and real-node count from cluster.env
# (not its shape: flags keep theirs); false if there is none.
load_state() {
  [[ -f $STATE/cluster.env ]] || return 1
  local key value
  REAL_NODES_UP=0
  while IFS='=' read -r key value; do
    if [[ $key =~ ^([A-Z_]+_PORT|APISERVER_URL|REAL_NODES_UP)$ ]]; then printf -v "$key" '%s' "$value"; fi
  done < "$STATE/cluster.env"
}

known_clusters() {
  local env names=""
  for env in "$CACHE"/clusters/*/cluster.env; do
    [[ -f $env ]] && names+=" $(basename "$(dirname "$env")")"
  done
  echo "${names:- (none)}"
}

# ---------------------------------------------------------------- commands

cmd_up() {
  local t0=$SECONDS c running=0
  for c in $COMPONENTS; do alive "$c" && running=$((running + 1)); done
  if ((running == 5)) && load_state && ((REAL_NODES_UP == REAL_NODES)); then
    log "already running ($STATE/kubeconfig)"
    echo "$STATE/kubeconfig"; return 0
  fi
  ((running == 0)) && [[ ! -f $LEDGER ]] || { log "running in another shape or partly, restarting"; cmd_down; }

  trap up_failed EXIT
  TETRAD_TOOLS="etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok" \
    "$HACK/k8s-tools.sh" build >&2
  prepare_state
  prepare_real_host
  launch etcd 30
  launch kube-apiserver 90
  for c in kube-controller-manager kube-scheduler kwok; do "start_${c//-/_}"; done
  for c in kube-controller-manager kube-scheduler kwok; do await "$c" 60; done
  create_fake_nodes
  # The namespace's default ServiceAccount proves the controllers are working.
  must_wait kube-controller-manager "default ServiceAccount" 60 kctl get serviceaccount default -n default
  up_real_nodes

  trap - EXIT
  log "up in $((SECONDS - t0))s: $NODES fake nodes x $GPUS GPUs, $REAL_NODES real nodes, $APISERVER_URL"
  log "  export KUBECONFIG=$STATE/kubeconfig"
  echo "$STATE/kubeconfig"
}

# A failed `up` must not leave half a cluster running.
up_failed() {
  local rc=$? c
  ((rc != 0)) || return 0
  log "up failed; stopping the components already started (logs stay in $LOGS)"
  down_real_nodes || true
  for c in kwok kube-scheduler kube-controller-manager kube-apiserver etcd; do stop "$c" || true; done
  exit "$rc"
}

cmd_down() {
  if ! load_state; then
    log "error: no such cluster in $CACHE/clusters (TETRAD_CACHE=${TETRAD_CACHE:-unset}); nothing stopped"
    log "known clusters:$(known_clusters)"
    exit 1
  fi
  down_peers
  down_gang_schedulers
  down_real_nodes
  local c ports leftover=""
  ports=$(grep '_PORTS\{0,1\}=' "$STATE/cluster.env" | cut -d= -f2 | tr ',\n' '  ')
  # Reverse start order: clients first, etcd last.
  for c in kwok kube-scheduler kube-controller-manager kube-apiserver etcd; do
    local t0=$SECONDS; stop "$c"; ((SECONDS - t0 < 3)) || log "stopping $c took $((SECONDS - t0))s"
  done
  # Verify nothing we started still listens.
  local used p
  used=" $(listening_ports | tr '\n' ' ') "
  for p in $ports; do [[ $used == *" $p "* ]] && leftover+=" $p"; done
  [[ -z $leftover ]] || die "ports still listening after down:$leftover"
  # Keep logs and pki for post-mortems; drop the data.
  rm -rf "$STATE/data" "$RUN"
  log "down"
}

cmd_load() {
  ((${#ARCHIVES[@]} > 0)) || die "load: name at least one OCI archive"
  if ! load_state || ((REAL_NODES_UP == 0)); then die "load: cluster $NAME has no real nodes running"; fi
  check_room_for_images "$REAL_NODES_UP" "${ARCHIVES[@]}"
  local i failed=0
  local -a imports=()
  # Every node at once: an import is mostly one core decompressing and the disk writing.
  for ((i = 0; i < REAL_NODES_UP; i++)); do
    load_images "$i" "${ARCHIVES[@]}" &
    imports+=($!)
  done
  for i in "${imports[@]}"; do wait "$i" || failed=1; done
  ((failed == 0)) || die "load: an import failed (see above)"
}

cmd_status() {
  if ! load_state; then
    echo "cluster $NAME: not created in $CACHE/clusters; known:$(known_clusters)"
    return 3
  fi
  local c rc=0 pid
  echo "cluster $NAME ($STATE)"
  local real=""
  for c in "$RUN"/kubelet-*.pid "$RUN"/containerd-*.pid "$RUN"/coredns.pid "$RUN"/scheduler-plugins-*.pid "$RUN"/kueue.pid; do
    [[ -f $c ]] && real+=" $(basename "$c" .pid)"
  done
  for c in $COMPONENTS $real; do
    if alive "$c"; then
      read -r pid _ < "$RUN/$c.pid"; printf '  %-30s running (pid %s)\n' "$c" "$pid"
    else
      printf '  %-30s stopped\n' "$c"; rc=3
    fi
  done
  if ((rc == 0)); then
    echo "  APISERVER_URL=$APISERVER_URL"
    echo "  nodes ready: $(ready_nodes)"
  fi
  return $rc
}

case $CMD in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  kubeconfig) echo "$STATE/kubeconfig" ;;
  load) cmd_load ;;
  scheduler) cmd_scheduler ;;
  peer) cmd_peer ;;
  env) echo "$STATE/cluster.env" ;;
  *) usage ;;
esac
