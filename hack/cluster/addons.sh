# shellcheck shell=bash
# What the components started beside a running cluster share, for
# hack/cluster.sh (sourced by it): the gang schedulers
# (hack/cluster/gang-schedulers.sh) and the benchmark's peers
# (hack/cluster/peers.sh). Each is built from a pinned Go module
# (hack/tools/<wrapper>/go.mod), talks to the apiserver as a system:masters
# client of its own, keeps its ports in cluster.env, and serves its webhooks on
# loopback.

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

# crds_established CRD...: wait, 60 s at most, until the apiserver serves
# them (`kubectl wait` fails outright on a CRD that has no conditions yet).
crds_established() {
  local crd t0=$SECONDS
  for crd in "$@"; do
    until [[ $(kctl get crd "$crd" -o jsonpath='{.status.conditions[?(@.type=="Established")].status}' 2>/dev/null) == True ]]; do
      ((SECONDS - t0 < 60)) || die "CRD $crd not Established after 60s"
      sleep 0.2
    done
  done
}

# start_addon COMMAND NAMES: `hack/cluster.sh COMMAND NAME` for the one NAME
# given, which must be among NAMES: up_<NAME>, timed.
start_addon() {
  [[ ${#ARCHIVES[@]} == 1 && " $2 " == *" ${ARCHIVES[0]} "* ]] || die "$1: name one of: $2"
  # shellcheck disable=SC2153  # NAME is hack/cluster.sh's
  load_state || die "$1: cluster $NAME is not up"
  local t0=$SECONDS
  "up_${ARCHIVES[0]//-/_}"
  log "${ARCHIVES[0]} up in $((SECONDS - t0))s"
}

# stop_addons COMPONENTS NAMES: stop every component that the associative
# array named COMPONENTS lists for the NAMES.
stop_addons() {
  local -n components=$1
  local n c
  for n in $2; do
    for c in ${components[$n]}; do stop "$c"; done
  done
}

# launch_components SECONDS COMPONENT...: build them where stale, start those
# not running yet, then await them all.
launch_components() {
  local limit=$1 c; shift
  TETRAD_TOOLS="$*" "$HACK/k8s-tools.sh" build >&2
  for c in "$@"; do
    alive "$c" || "start_${c//-/_}"
  done
  for c in "$@"; do await "$c" "$limit"; done
}

# webhook_served PORT PATH: the component's webhook server answers on PATH
# (readyz says only that the server listens; the handlers come a moment later).
webhook_served() {
  local code
  code=$(curl -sk -o /dev/null -w '%{http_code}' -X POST "https://127.0.0.1:$1$2")
  [[ $code != 000 && $code != 404 ]]
}

# The extensions of a webhook server's certificate for DNS (its Service name)
# and 127.0.0.1, where the apiserver calls it here.
serving_cert_ext() {
  printf '%s' "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=DNS:$1,IP:127.0.0.1"
}

# cert_files NAME DIR: certificate NAME's files as a webhook server reads them
# from its directory (tls.crt, tls.key).
cert_files() {
  mkdir -p "$2"
  cp "$PKI/$1.crt" "$2/tls.crt"
  cp "$PKI/$1.key" "$2/tls.key"
}

# serving_cert NAME DNS DIR: a webhook server certificate from the cluster's CA,
# made once, into DIR, for a component that takes its certificates from there.
serving_cert() {
  [[ -f $PKI/$1.crt ]] || sign "$1" "/CN=$2" "$(serving_cert_ext "$2")"
  cert_files "$1" "$3"
}

# rotator_secret NAME DNS NAMESPACE SECRET CERT_DIR: the Secret a component's
# own certificate management (cert-controller's rotator, as its release
# manifests run it) finds and keeps, because its certificates are valid for its
# Service name DNS (and for 127.0.0.1); and their copy in CERT_DIR, where its
# pod would mount the Secret and where the rotator waits to see them. The
# rotator's CA is named NAME-ca (its CN and a DNS name, as it checks), with the
# PKCS#1 RSA key it parses; the Secret holds the CA's key, so the CA is the
# component's own, not the cluster's.
rotator_secret() {
  local name=$1 dns=$2
  [[ -f $PKI/$name-ca.crt ]] || {
    openssl genrsa -traditional -out "$PKI/$name-ca.key" 2048 2>/dev/null
    openssl req -x509 -new -key "$PKI/$name-ca.key" -subj "/O=$name/CN=$name-ca" -days 3650 \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,digitalSignature,keyEncipherment" \
      -addext "subjectAltName=DNS:$name-ca" -out "$PKI/$name-ca.crt" 2>/dev/null
    sign "$name-webhook" "/CN=$dns" "$(serving_cert_ext "$dns")" "$name-ca"
  }
  kctl create secret generic "$4" -n "$3" --dry-run=client -o yaml \
    --from-file ca.crt="$PKI/$name-ca.crt" --from-file ca.key="$PKI/$name-ca.key" \
    --from-file tls.crt="$PKI/$name-webhook.crt" --from-file tls.key="$PKI/$name-webhook.key" | kctl apply -f - >&2
  cert_files "$name-webhook" "$5"
}

# webhooks_on_loopback PREFIX PORT CA_FILE MANIFEST [POD_LABEL]: the manifest's
# webhook configurations, renamed PREFIX-<name>, each webhook calling
# https://127.0.0.1:PORT<its Service path> and trusting CA_FILE (none given:
# the component puts its CA in itself). Pod webhooks see only the pods that
# carry the label POD_LABEL, so nobody else's pod waits for the component.
webhooks_on_loopback() {
  local ca=""
  [[ -z $3 ]] || ca=$(base64 -w0 < "$3")
  kctl create --dry-run=client -o json -f "$4" |
    jq --arg url "https://127.0.0.1:$2" --arg prefix "$1" --arg ca "$ca" --arg podlabel "${5:-}" '
      .metadata.name = $prefix + "-" + .metadata.name
      | .webhooks |= map(
          .clientConfig = ({url: ($url + .clientConfig.service.path)} + (if $ca == "" then {} else {caBundle: $ca} end))
          | if $podlabel != "" and (.rules | any(.resources | index("pods"))) then
              .objectSelector = {matchExpressions: [{key: $podlabel, operator: "Exists"}]}
            else . end)'
}
