# shellcheck shell=bash
# Real nodes for hack/cluster.sh (sourced by it): `up --real-nodes N` adds N
# kubelet nodes beside the kwok ones, each with its own containerd (own root,
# state, socket and cgroup), a CNI bridge, and one CoreDNS for the cluster.
#
# Invariants
# - Every address lies in 198.18.0.0/15: node i is the bridge <tag>b<i> at
#   198.18.i.1/24 and its pods take 198.18.i.0/24 (ipMasq off, so packets keep
#   their pod source). The services bridge <tag>svc (no ports) holds the
#   apiserver's address 198.18.255.1 and CoreDNS's 198.18.255.53; Services take
#   198.19.0.0/16 and one kube-proxy (nftables) serves them. Pods on different
#   nodes reach each other through the host's routes between the bridges.
#   Nothing is routed anywhere else.
# - Every change to the host is written to $REAL/ledger *before* it is made,
#   and `down` undoes what the ledger lists and whatever the kubelets and
#   containerds made below the node cgroups and bridges, so a crash at any
#   point is cleaned up by the next `down`.
# - Every start is bounded (must_wait) and logs to $LOGS.

REAL=$STATE/real
LEDGER=$REAL/ledger
CNI_BIN=/usr/lib/cni
DNS_IP=198.18.255.53
REAL_APISERVER_IP=198.18.255.1
CLUSTER_DOMAIN=cluster.local
# One interface-name tag per cluster name, short enough for "<tag>b15" (IFNAMSIZ 16).
# shellcheck disable=SC2153  # NAME is hack/cluster.sh's
TAG=t$(cksum <<< "$NAME" | awk '{ printf "%05d", $1 % 100000 }')

ledger() { echo "$*" >> "$LEDGER"; }

# The kernel tunables the kubelet sets at start (protectKernelDefaults: false),
# and those kube-proxy may set (its conntrack settings are 0, "leave alone";
# listed in case a version disagrees).
KUBELET_SYSCTLS="vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys kernel.keys.root_maxbytes"
KUBE_PROXY_SYSCTLS="net.ipv4.conf.all.route_localnet net.netfilter.nf_conntrack_max net.netfilter.nf_conntrack_tcp_timeout_established net.netfilter.nf_conntrack_tcp_timeout_close_wait"

# v1 controllers and the v2 hierarchy, as mounted here.
cgroup_mounts() {
  local d
  for d in /sys/fs/cgroup/*/; do
    d=${d%/}
    [[ -L $d || ! -f $d/cgroup.procs ]] || echo "$d"
  done
}
node_cgroup() { echo "/tetrad-$NAME-n$1"; }

# make_cgroup REL: create REL in every hierarchy; cpuset needs cpus and mems
# filled in before a task can join it.
make_cgroup() {
  local rel=$1 m dir part path
  ledger cgroup "$rel"
  for m in $(cgroup_mounts); do
    path=$m
    IFS=/ read -ra part <<< "${rel#/}"
    for dir in "${part[@]}"; do
      path+=/$dir
      mkdir -p "$path"
      if [[ $m == */cpuset && -f $path/cpuset.cpus && -z $(cat "$path/cpuset.cpus") ]]; then
        cat "$(dirname "$path")/cpuset.cpus" > "$path/cpuset.cpus"
        cat "$(dirname "$path")/cpuset.mems" > "$path/cpuset.mems"
      fi
    done
  done
}

cgroup_pids() {
  local m rel=$1
  for m in $(cgroup_mounts); do
    [[ -d $m$rel ]] && find "$m$rel" -name cgroup.procs -exec cat {} + 2>/dev/null
  done | sort -u
}

# start_in_cgroup NAME CGROUP BINARY ARGS...: like `start`, the process (and
# whatever it forks, containerd's shims included) placed in CGROUP.
start_in_cgroup() {
  local name=$1 rel=$2; shift 2
  local -a procs=()
  local m
  for m in $(cgroup_mounts); do procs+=("$m$rel/cgroup.procs"); done
  # shellcheck disable=SC2016  # expanded by the inner bash
  setsid bash -c 'for f in "${@:2:$1}"; do echo $$ > "$f"; done; shift $(($1 + 1)); exec "$@"' \
    _ "${#procs[@]}" "${procs[@]}" "$@" </dev/null >"$LOGS/$name.log" 2>&1 &
  local pid=$!
  echo "$pid $(proc_start "$pid")" > "$RUN/$name.pid"
}

# set_sysctl KEY VALUE: remember the previous value once, then set it.
set_sysctl() {
  local key=$1 file=/proc/sys/${1//.//}
  grep -q "^sysctl $key " "$LEDGER" 2>/dev/null || ledger sysctl "$key" "$(cat "$file")"
  echo "$2" > "$file"
}

# Directories the kubelet or containerd create at fixed paths: removed by
# `down` only if they did not exist before.
FIXED_DIRS="/var/lib/kubelet /var/log/pods /var/log/containers /var/lib/cni /run/netns /run/containerd /etc/cni /opt/cni"
record_fixed_dirs() {
  local d
  for d in $FIXED_DIRS; do
    [[ -e $d ]] || grep -qx "dir $d" "$LEDGER" 2>/dev/null || ledger dir "$d"
  done
}

real_node_certs() {
  local i
  for ((i = 0; i < REAL_NODES; i++)); do
    sign "real-node-$i" "/O=system:nodes/CN=system:node:real-node-$i" "$CLIENT_CERT"
    write_kubeconfig "$STATE/real-node-$i.kubeconfig" "real-node-$i"
  done
  sign coredns "/CN=tetrad:coredns" "$CLIENT_CERT"
  write_kubeconfig "$STATE/coredns.kubeconfig" coredns
  sign kube-proxy "/CN=system:kube-proxy" "$CLIENT_CERT"
  write_kubeconfig "$STATE/kube-proxy.kubeconfig" kube-proxy
}

# What the kubelets and CoreDNS may do, bound before they start.
real_node_rbac() {
  kctl apply -f - >/dev/null <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: tetrad:real-nodes}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: system:node}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: Group, name: system:nodes}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: tetrad:coredns}
rules:
- {apiGroups: [""], resources: [endpoints, services, pods, namespaces], verbs: [list, watch]}
- {apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: tetrad:coredns}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: tetrad:coredns}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: "tetrad:coredns"}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: tetrad:kube-proxy}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: system:node-proxier}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:kube-proxy"}]
EOF
}

write_containerd_config() {
  local i=$1 d=$REAL/n$1 pause=$2 stream_port=$3
  mkdir -p "$d/cni-conf" "$d/etc" "$d/containerd-root" "$d/containerd-state" "$d/cni-ipam"
  cat > "$d/etc/containerd.toml" <<EOF
version = 2
root = "$d/containerd-root"
state = "$d/containerd-state"
oom_score = 0
[grpc]
  address = "$d/containerd.sock"
[ttrpc]
  address = "$d/containerd.sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$pause"
  stream_server_address = "127.0.0.1"
  stream_server_port = "$stream_port"
  enable_selinux = false
  # Without CAP_SYS_RESOURCE a sandbox cannot lower its oom_score_adj.
  restrict_oom_score_adj = true
  max_container_log_line_size = 16384
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN"
    conf_dir = "$d/cni-conf"
    max_conf_num = 1
[plugins."io.containerd.internal.v1.opt"]
  path = "$d/opt"
EOF
  cat > "$d/cni-conf/10-$TAG-b$i.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "$TAG-b$i",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "${TAG}b$i",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "dataDir": "$d/cni-ipam",
        "ranges": [[{"subnet": "198.18.$i.0/24", "gateway": "198.18.$i.1"}]],
        "routes": [{"dst": "198.18.0.0/15"}]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
}

write_kubelet_config() {
  local i=$1 d=$REAL/n$1 port=$2 healthz=$3
  mkdir -p "$d/kubelet" "$d/pki"
  # Pods resolve through CoreDNS only: no host search domains, no upstream.
  echo "nameserver $DNS_IP" > "$d/etc/resolv.conf"
  cat > "$d/etc/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failCgroupV1: false
cgroupsPerQOS: true
cgroupRoot: $(node_cgroup "$i")
enforceNodeAllocatable: ["pods"]
containerRuntimeEndpoint: unix://$d/containerd.sock
imageServiceEndpoint: unix://$d/containerd.sock
address: 198.18.$i.1
port: $port
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $healthz
failSwapOn: false
resolvConf: $d/etc/resolv.conf
clusterDNS: [$DNS_IP]
clusterDomain: $CLUSTER_DOMAIN
registerNode: true
maxOpenFiles: 20000
serializeImagePulls: false
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization:
  mode: Webhook
staticPodPath: ""
shutdownGracePeriod: 0s
podLogsDir: $d/pod-logs
# The nodes share the host's disk with everything else on it: evict only when
# it is truly full (an absolute figure, not a share of a disk the cluster does
# not own), and never remove an image, since no registry can give it back
# (up checks there is room for them: check_room_for_images).
evictionHard:
  memory.available: "100Mi"
  nodefs.available: "512Mi"
  imagefs.available: "512Mi"
  nodefs.inodesFree: "1%"
imageGCHighThresholdPercent: 99
imageGCLowThresholdPercent: 98
imageMinimumGCAge: 87600h
EOF
}

write_corefile() {
  cat > "$ETC/Corefile" <<EOF
.:53 {
    bind $DNS_IP
    errors
    health 127.0.0.1:$COREDNS_HEALTH_PORT
    ready 127.0.0.1:$COREDNS_READY_PORT
    kubernetes $CLUSTER_DOMAIN in-addr.arpa ip6.arpa {
        kubeconfig $STATE/coredns.kubeconfig $NAME
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    # No forward plugin: names outside the cluster are not resolved, so no
    # query ever leaves the machine.
    cache 5
}
EOF
}

# One kube-proxy for every node: they share the host's network namespace, so
# one set of nftables rules serves them all. It proxies Service traffic from
# the pods only (node ports on the services address alone) and leaves the
# host's conntrack settings as they are.
write_kube_proxy_config() {
  cat > "$ETC/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
clientConnection: {kubeconfig: $STATE/kube-proxy.kubeconfig}
hostnameOverride: real-node-0
clusterCIDR: 198.18.0.0/16
nodePortAddresses: [$REAL_APISERVER_IP/32]
bindAddress: 127.0.0.1
healthzBindAddress: 127.0.0.1:$KUBE_PROXY_HEALTH_PORT
metricsBindAddress: 127.0.0.1:$KUBE_PROXY_METRICS_PORT
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
  udpTimeout: 0s
  udpStreamTimeout: 0s
EOF
}

# check_room_for_images NODES ARCHIVE...: fail, saying how much is missing,
# unless the disk under $REAL can hold the archives in NODES containerds. Each
# keeps an archive twice (its content store and the unpacked snapshot); 4 GiB
# more is for the pods' logs and checkpoints. A full disk would otherwise make
# the kubelets evict pods, and nothing could pull a side-loaded image back.
check_room_for_images() {
  local nodes=$1 archive bytes=0 need free gib=$((1 << 30)); shift
  for archive in "$@"; do
    [[ -f $archive ]] || die "no such image archive: $archive"
    bytes=$((bytes + $(stat -c %s "$archive")))
  done
  need=$((2 * bytes * nodes + 4 * gib))
  free=$(df --output=avail -B1 "$REAL" | tail -1)
  ((free >= need)) || die "not enough disk for the images of $nodes real node(s): about $(((need + gib - 1) / gib)) GiB needed on $(df --output=target "$REAL" | tail -1) ($(((free) / gib)) GiB free): each node keeps $(((bytes + gib - 1) / gib)) GiB of image archives twice, plus 4 GiB for pods. Free some space (old clones, caches, /tmp) or ask for fewer real nodes"
}

# load_images I ARCHIVE...: import OCI archives into node i's containerd, under
# the names they were built with (what the pods' specs say).
load_images() {
  local i=$1 archive; shift
  for archive in "$@"; do
    ctr --address "$REAL/n$i/containerd.sock" -n k8s.io images import "$archive" >/dev/null ||
      die "importing $archive into real-node-$i failed"
  done
}

# The bridge of node i, up with its gateway address, before anything uses it.
make_bridge() {
  local link=${TAG}b$1
  ledger link "$link"
  ip link add "$link" type bridge
  ip addr add "198.18.$1.1/24" dev "$link"
  ip link set "$link" up
}

healthy_real_node() { [[ $(kctl get node "real-node-$1" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null) == True ]]; }
healthy_containerd() { ctr --address "$REAL/n$1/containerd.sock" version; }
healthy_coredns() { curl -sf "http://127.0.0.1:$COREDNS_READY_PORT/ready"; }
healthy_kube_proxy() { curl -sf "http://127.0.0.1:$KUBE_PROXY_HEALTH_PORT/healthz"; }

# Before the control plane starts: the host checks, the ledger, and the
# services bridge with the apiserver's address.
prepare_real_host() {
  ((REAL_NODES > 0)) || return 0
  ((REAL_NODES <= 16)) || die "--real-nodes: at most 16 (node i uses 198.18.i.0/24)"
  [[ $(id -u) == 0 ]] || die "--real-nodes needs root (bridges, cgroups, containerd)"
  "$HACK/host-packages.sh" >&2
  if ip -o -4 addr show | grep -q ' inet 198\.1[89]\.'; then
    die "198.18.0.0/15 is already in use on this machine (another real-node cluster?): $(ip -o -4 addr show | awk '/ inet 198\.1[89]\./ { print $2 }' | tr '\n' ' ')"
  fi
  mkdir -p "$REAL"
  ledger "# real nodes of $NAME: undone in reverse by hack/cluster.sh down"
  # nftables (iptables-nft included) as it was: restored as a whole by `down`.
  nft list ruleset > "$REAL/nft.before"
  ledger nft "$REAL/nft.before"
  record_fixed_dirs
  set_sysctl net.ipv4.ip_forward 1
  # The kubelet sets these itself; listed (unchanged here) so that `down` restores them.
  local key
  for key in $KUBELET_SYSCTLS; do set_sysctl "$key" "$(cat "/proc/sys/${key//.//}")"; done
  for key in $KUBE_PROXY_SYSCTLS; do
    [[ -f /proc/sys/${key//.//} ]] && set_sysctl "$key" "$(cat "/proc/sys/${key//.//}")"
  done
  local link=${TAG}svc
  ledger link "$link"
  ip link add "$link" type bridge  # no ports: addresses of its own (no dummy module on this kernel)
  ip addr add "$REAL_APISERVER_IP/32" dev "$link"
  ip addr add "$DNS_IP/32" dev "$link"
  ip link set "$link" up
}

# After the control plane: certificates, the nodes, CoreDNS and kube-proxy.
up_real_nodes() {
  ((REAL_NODES > 0)) || return 0
  TETRAD_TOOLS="kubelet kube-proxy coredns" "$HACK/k8s-tools.sh" build >&2
  local pause archives
  archives=$("$HACK/node-images.sh" build)
  pause=$(awk 'NR == 1 { print $1 }' <<< "$archives")
  # shellcheck disable=SC2046  # one archive path per line
  check_room_for_images "$REAL_NODES" $(awk '{ print $2 }' <<< "$archives")
  real_node_certs
  real_node_rbac
  local i taken=() port healthz stream
  read -ra taken <<< "$(grep '_PORT=' "$STATE/cluster.env" | cut -d= -f2 | tr '\n' ' ')"
  for ((i = 0; i < REAL_NODES; i++)); do
    port=$(free_port "${taken[@]}"); taken+=("$port")
    healthz=$(free_port "${taken[@]}"); taken+=("$healthz")
    stream=$(free_port "${taken[@]}"); taken+=("$stream")
    echo "REAL_NODE_${i}_PORTS=$port,$healthz,$stream" >> "$STATE/cluster.env"
    make_bridge "$i"
    make_cgroup "$(node_cgroup "$i")"
    make_cgroup "$(node_cgroup "$i")/runtime"
    write_containerd_config "$i" "$pause" "$stream"
    write_kubelet_config "$i" "$port" "$healthz"
    start_in_cgroup "containerd-$i" "$(node_cgroup "$i")/runtime" \
      containerd --config "$REAL/n$i/etc/containerd.toml"
  done
  for ((i = 0; i < REAL_NODES; i++)); do
    must_wait "containerd-$i" "containerd of real-node-$i" 30 healthy_containerd "$i"
    # shellcheck disable=SC2046  # one archive path per line
    load_images "$i" $(awk '{ print $2 }' <<< "$archives")
    start_in_cgroup "kubelet-$i" "$(node_cgroup "$i")/runtime" "$BIN/kubelet" \
      --config "$REAL/n$i/etc/kubelet.yaml" --kubeconfig "$STATE/real-node-$i.kubeconfig" \
      --root-dir "$REAL/n$i/kubelet" --cert-dir "$REAL/n$i/pki" \
      --hostname-override "real-node-$i" --node-ip "198.18.$i.1" \
      --node-labels "tetrad.dev/real-node=true"
  done
  COREDNS_HEALTH_PORT=$(free_port "${taken[@]}"); taken+=("$COREDNS_HEALTH_PORT")
  COREDNS_READY_PORT=$(free_port "${taken[@]}"); taken+=("$COREDNS_READY_PORT")
  KUBE_PROXY_HEALTH_PORT=$(free_port "${taken[@]}"); taken+=("$KUBE_PROXY_HEALTH_PORT")
  KUBE_PROXY_METRICS_PORT=$(free_port "${taken[@]}")
  echo "COREDNS_PORTS=$COREDNS_HEALTH_PORT,$COREDNS_READY_PORT" >> "$STATE/cluster.env"
  echo "KUBE_PROXY_PORTS=$KUBE_PROXY_HEALTH_PORT,$KUBE_PROXY_METRICS_PORT" >> "$STATE/cluster.env"
  write_corefile
  start coredns -conf "$ETC/Corefile"
  write_kube_proxy_config
  start kube-proxy --config "$ETC/kube-proxy.yaml"
  must_wait coredns "CoreDNS ready" 60 healthy_coredns
  must_wait kube-proxy "kube-proxy healthy" 60 healthy_kube_proxy
  for ((i = 0; i < REAL_NODES; i++)); do
    must_wait "kubelet-$i" "real-node-$i Ready" 120 healthy_real_node "$i"
  done
  echo "REAL_NODES_UP=$REAL_NODES" >> "$STATE/cluster.env"
  echo "DNS_IP=$DNS_IP" >> "$STATE/cluster.env"
  log "real nodes: $REAL_NODES (containerd + kubelet each, pods in 198.18.<i>.0/24, DNS $DNS_IP, apiserver $REAL_APISERVER_IP)"
}

# Undo everything of the real nodes, from the ledger and from what lies below
# the node cgroups and bridges; safe to repeat, and after a crash.
down_real_nodes() {
  [[ -f $LEDGER ]] || return 0
  local i kind arg value pid
  # Processes first: the kubelets, then everything in the node cgroups
  # (containerd, its shims, every container), then CoreDNS.
  for f in "$RUN"/kubelet-*.pid; do [[ -f $f ]] && stop "$(basename "$f" .pid)"; done
  local -a cgroups=()
  mapfile -t cgroups < <(awk '$1 == "cgroup" { print $2 }' "$LEDGER")
  local t0=$SECONDS left
  while :; do
    left=""
    for arg in "${cgroups[@]}"; do left+=$(cgroup_pids "$arg" | tr '\n' ' '); done
    [[ -n ${left// /} ]] || break
    ((SECONDS - t0 < 20)) || die "processes left in the node cgroups after 20s: $left"
    for pid in $left; do kill -KILL "$pid" 2>/dev/null || true; done
    sleep 0.2
  done
  for f in "$RUN"/containerd-*.pid "$RUN"/coredns.pid "$RUN"/kube-proxy.pid; do [[ -f $f ]] && stop "$(basename "$f" .pid)"; done
  # Pod network namespaces of our bridges (containerd names them cni-<uuid>).
  local ns subnets
  subnets=$(awk '$1 == "link" && $2 ~ /b[0-9]+$/ { sub(/.*b/, "", $2); printf " 198.18.%s.", $2 }' "$LEDGER")
  for ns in /run/netns/cni-*; do
    [[ -e $ns ]] || continue
    local addrs; addrs=$(ip -n "$(basename "$ns")" -o -4 addr show 2>/dev/null | awk '{ print $4 }' | tr '\n' ' ')
    for arg in $subnets; do
      if [[ " $addrs" == *" ${arg# }"* ]]; then ip netns delete "$(basename "$ns")" 2>/dev/null || { umount -l "$ns"; rm -f "$ns"; }; break; fi
    done
  done
  # Mounts below the node directories (the kubelet bind-mounts its root, the
  # shims mount rootfs and shm), deepest first.
  local m
  awk -v r="$REAL/" 'index($5, r) == 1 { print $5 }' /proc/self/mountinfo | sort -r |
    while read -r m; do umount "$m" 2>/dev/null || umount -l "$m"; done
  # The ledger in reverse: links, nftables, sysctls, cgroups, fixed dirs.
  tac "$LEDGER" | while read -r kind arg value; do
    case $kind in
      link) ip link show "$arg" >/dev/null 2>&1 && ip link delete "$arg" ;;
      nft) [[ -f $arg ]] && { echo "flush ruleset"; cat "$arg"; } | nft -f - ;;
      sysctl) echo "$value" > "/proc/sys/${arg//.//}" ;;
      cgroup)
        for m in $(cgroup_mounts); do
          [[ -d $m$arg ]] && find "$m$arg" -depth -type d -exec rmdir {} + 2>/dev/null
          [[ ! -d $m$arg ]] || die "cgroup $m$arg could not be removed"
        done ;;
      dir)
        awk -v r="$arg/" 'index($5, r) == 1 { print $5 }' /proc/self/mountinfo | sort -r |
          while read -r m; do umount -l "$m"; done
        rm -rf "$arg" ;;
    esac
  done
  # CNI leftovers on links we did not list (veths of killed pods).
  local veth
  for veth in $(ip -o link show type veth 2>/dev/null | awk -F': ' '{ print $2 }' | cut -d@ -f1); do
    ip -o link show "$veth" | grep -q "master $TAG" && ip link delete "$veth" 2>/dev/null || true
  done
  rm -rf "$REAL"
}
