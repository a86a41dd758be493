#!/usr/bin/env bash
# Build the project's images without Docker or a registry: a Python base image
# bootstrapped from Debian's packages (debootstrap, then `buildah from
# scratch`), and the top-level Dockerfile's targets built on it with buildah.
# Each image is written as an OCI archive to $TETRAD_CACHE/images, keyed by its
# inputs (for a target: the Dockerfile, pyproject.toml, README.md and every
# file of the packages it copies), so a warm machine rebuilds nothing; buildah
# keeps the Dockerfile's layers, so a change to the sources rebuilds only the
# last layer, not the trainer's 4 GB of dependencies.
#
#   hack/images.sh base                 the Python base image
#   hack/images.sh operator|trainer     a Dockerfile target (builds base first)
#   hack/images.sh example NAME         examples/bring-your-own/NAME/Dockerfile (script,
#                                       hf-trainer) on Tetrad's image it names, as a thin
#                                       archive: import the trainer's archive first
# Each prints "IMAGE-NAME ARCHIVE". Root only (debootstrap, chroot).
#
# Environment: TETRAD_TORCH_INDEX  --build-arg TORCH_INDEX for the trainer (a CPU wheel index)
set -euo pipefail

HACK=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HACK")
CACHE=$(dirname "$("$HACK/k8s-tools.sh" bindir)")
OUT=$CACHE/images
SUITE=bookworm                  # Python 3.11, as the Dockerfile's default python:3.11-slim
MIRROR=http://deb.debian.org/debian
BASE_IMAGE=localhost/tetrad/python:3.11
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO/pyproject.toml" | head -1)
# buildah keeps one store in the cache (overlay: layers share their files), so the
# base image and the dependency layers are built once; it leaves no mount behind.
B=(buildah --root "$OUT/store/root" --runroot "$OUT/store/run" --storage-driver overlay
   --storage-opt overlay.skip_mount_home=true)
# pip in a build trusts what the host's pip trusts (a proxy's CA, say): the host's pip.conf and CA
# bundle are mounted for the RUN steps only, never committed.
TRUST=()
for f in /etc/pip.conf /etc/ssl/certs/ca-certificates.crt; do
  [[ -f $f ]] && TRUST+=(--volume "$f:$f:ro")
done

log() { echo "images: $*" >&2; }
key_of() { cat "$@" | sha256sum | cut -c1-16; }

build_base() {
  local key archive
  key=$(key_of <(declare -f build_base; echo "$SUITE $MIRROR"))
  archive=$OUT/python-$key.tar
  if [[ ! -f $archive ]]; then
    local rootfs t0=$SECONDS ctr
    rootfs=$(mktemp -d "$OUT/.rootfs.XXXXXX")
    mkdir -p "$OUT/debs"
    log "debootstrap $SUITE (minbase + python3) ..."
    debootstrap --variant=minbase --include=python3,python3-venv --cache-dir="$OUT/debs" \
      "$SUITE" "$rootfs" "$MIRROR" >"$OUT/debootstrap.log" 2>&1 ||
      { tail -20 "$OUT/debootstrap.log" >&2; exit 1; }
    # `python` and `pip` as on the official image: a venv first on PATH (Debian's
    # own python3 is externally managed, PEP 668).
    chroot "$rootfs" python3 -m venv /opt/python
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    ctr=$("${B[@]}" from scratch)
    "${B[@]}" copy --quiet "$ctr" "$rootfs/" / >/dev/null
    "${B[@]}" config --env PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      --env LANG=C.UTF-8 --cmd '["python3"]' --os linux --arch amd64 "$ctr"
    "${B[@]}" commit --quiet "$ctr" "$BASE_IMAGE" >/dev/null
    "${B[@]}" rm "$ctr" >/dev/null
    "${B[@]}" push --quiet "$BASE_IMAGE" "oci-archive:$archive.tmp:$BASE_IMAGE"
    mv -f "$archive.tmp" "$archive"
    rm -rf "$rootfs"
    log "base built in $((SECONDS - t0))s"
  elif ! "${B[@]}" inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
    "${B[@]}" pull --quiet "oci-archive:$archive" >/dev/null
  fi
  echo "$BASE_IMAGE $archive"
}

# bud ARGS...: `buildah bud` as every build here needs it: chroot isolation (no OCI runtime for RUN),
# the host's trust for pip, ulimits within the hard limits (the defaults need CAP_SYS_RESOURCE).
bud() {
  "${B[@]}" bud --quiet --isolation chroot "${TRUST[@]}" \
    --ulimit nofile=20000:20000 --ulimit nproc=4096:4096 "$@" >/dev/null
}

# bud_target TARGET NAME: a target of the Dockerfile (its layers cached in the store).
bud_target() {
  (cd "$REPO" && bud --layers --build-arg PYTHON="$BASE_IMAGE" \
    --build-arg TORCH_INDEX="${TETRAD_TORCH_INDEX:-}" --target "$1" -t "$2" -f Dockerfile .)
}

build_target() {
  local target=$1 name key archive
  name=docker.io/tetrad/$target:$VERSION   # what the renderer and the chart write: tetrad/<target>:<version>
  build_base >/dev/null
  # What the Dockerfile copies (.dockerignore leaves out caches), this recipe and the target.
  key=$(cd "$REPO" && find Dockerfile pyproject.toml README.md hack/images/requirements-of.py \
      tetrad operator trainer-image -type f \
      ! -path '*/__pycache__/*' ! -path '*.egg-info/*' -print0 | sort -z | xargs -0 sha256sum |
    cat - "$HACK/images.sh" <(echo "$target ${TETRAD_TORCH_INDEX:-}") | sha256sum | cut -c1-16)
  archive=$OUT/$target-$key.tar
  if [[ ! -f $archive ]]; then
    local t0=$SECONDS
    log "building $name ..."
    bud_target "$target" "$name"
    # zstd: the trainer's 5.7 GB layer compresses in a third of gzip's time (containerd 1.6 reads it).
    "${B[@]}" push --quiet --compression-format zstd "$name" "oci-archive:$archive.tmp:$name"
    mv -f "$archive.tmp" "$archive"
    find "$OUT" -maxdepth 1 -name "$target-*.tar" ! -path "$archive" -delete  # the last build's only
    # Earlier builds' images go (the current ones' layers, the next build's cache, stay): each
    # trainer build that changed its dependencies would otherwise keep another 6 GB.
    "${B[@]}" rmi --prune >/dev/null 2>&1 || true
    log "$target built in $((SECONDS - t0))s"
  fi
  echo "$name $archive"
}

# The image each example is built FROM (its Dockerfile's BASE): the Dockerfile's `torch` target (the
# trainer's dependencies, nothing of Tetrad) or the trainer. Both are the trainer's archive's layers, or
# a part of them, so the example's archive holds only its own layers (hack/images/thin-archive.py).
declare -A EXAMPLE_BASE=([script]=torch [hf-trainer]=trainer)

build_example() {
  local example=$1 dir=$REPO/examples/bring-your-own/$1 trainer base name key archive
  [[ -n ${EXAMPLE_BASE[$example]:-} ]] || { log "no example image $example (one of: ${!EXAMPLE_BASE[*]})"; exit 2; }
  trainer=$(build_target trainer)
  trainer=${trainer#* }
  key=$(cat <(cd "$dir" && find . -type f -print0 | sort -z | xargs -0 sha256sum) "$HACK/images/thin-archive.py" \
    <(echo "$trainer ${EXAMPLE_BASE[$example]}") | sha256sum | cut -c1-16)
  name=docker.io/tetrad/example-$example:$VERSION
  archive=$OUT/example-$example-$key.tar
  if [[ ! -f $archive ]]; then
    local t0=$SECONDS layout
    base=docker.io/tetrad/${EXAMPLE_BASE[$example]}:$VERSION
    if [[ ${EXAMPLE_BASE[$example]} == torch ]]; then
      bud_target torch "$base"  # the trainer's cached layers, tagged
    fi
    log "building $name FROM $base ..."
    bud --pull=never --build-arg BASE="$base" -t "$name" "$dir"
    layout=$(mktemp -d "$OUT/.layout.XXXXXX")
    python3 "$HACK/images/thin-archive.py" placeholders "$trainer" "$layout"
    "${B[@]}" push --quiet "$name" "oci:$layout:$name"
    python3 "$HACK/images/thin-archive.py" pack "$trainer" "$layout" "$archive.tmp"
    mv -f "$archive.tmp" "$archive"
    rm -rf "$layout"
    find "$OUT" -maxdepth 1 -name "example-$example-*.tar" ! -path "$archive" -delete
    log "$name built in $((SECONDS - t0))s ($(du -h "$archive" | cut -f1) beside the trainer's archive)"
  fi
  echo "$name $archive"
}

[[ $(id -u) == 0 ]] || { log "needs root (debootstrap, chroot)"; exit 1; }
for tool in buildah debootstrap; do
  command -v "$tool" >/dev/null || { log "$tool is required (hack/host-packages.sh)"; exit 1; }
done
mkdir -p "$OUT"
exec 9>"$OUT/.images.lock"; flock 9
case ${1:-} in
  base) build_base ;;
  operator|trainer) build_target "$1" ;;
  example) build_example "${2:-}" ;;
  *) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 2 ;;  # the header comment
esac
