#!/usr/bin/env bash
# The two small images the real nodes need, built locally (no registry is
# reachable): the pod sandbox (pause, a 30-line Go program in hack/images/pause)
# and a busybox image from Debian's busybox-static, each with `buildah from
# scratch`, written as OCI archives to $TETRAD_CACHE/images and rebuilt only
# when their inputs change.
#
#   hack/node-images.sh build    build what is missing; print "NAME ARCHIVE" per image
#   hack/node-images.sh names    print the image names (pause first)
set -euo pipefail

HACK=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=$(dirname "$("$HACK/k8s-tools.sh" bindir)")
OUT=$CACHE/images
PAUSE_IMAGE=localhost/tetrad/pause:local
BUSYBOX_IMAGE=localhost/tetrad/busybox:local
# Applets the tests use; busybox-static's wget crashes here, nc works.
APPLETS="sh cat echo env hostname ip kill ls nc nslookup ps sleep true wc"

# Content key of an image: its recipe (this script) and its inputs.
key_of() { cat "$0" "$@" | sha256sum | cut -c1-16; }

# commit_image NAME ARCHIVE ROOTFS CMD-JSON: one layer, from scratch.
commit_image() {
  local name=$1 archive=$2 rootfs=$3 cmd=$4 tmp ctr
  tmp=$(mktemp -d "$OUT/.buildah.XXXXXX")
  local -a b=(buildah --root "$tmp/root" --runroot "$tmp/run" --storage-driver vfs)
  ctr=$("${b[@]}" from scratch)
  "${b[@]}" copy --quiet "$ctr" "$rootfs/" / >/dev/null
  "${b[@]}" config --cmd "$cmd" --os linux --arch amd64 "$ctr"
  "${b[@]}" commit --quiet --format oci "$ctr" "oci-archive:$archive.tmp:$name" >/dev/null
  "${b[@]}" rm "$ctr" >/dev/null
  rm -rf "$tmp"
  mv -f "$archive.tmp" "$archive"
}

build_pause() {
  local src=$HACK/images/pause key archive
  key=$(key_of "$src/main.go" "$src/go.mod" <(go version))
  archive=$OUT/pause-$key.tar
  if [[ ! -f $archive ]]; then
    local rootfs; rootfs=$(mktemp -d "$OUT/.rootfs.XXXXXX")
    (cd "$src" && GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-buildvcs=false \
      go build -trimpath -ldflags "-s -w" -o "$rootfs/pause" .)
    commit_image "$PAUSE_IMAGE" "$archive" "$rootfs" '["/pause"]'
    rm -rf "$rootfs"
  fi
  echo "$PAUSE_IMAGE $archive"
}

build_busybox() {
  local bb=/bin/busybox key archive a
  [[ -x $bb ]] || { echo "node-images: $bb missing (Debian package busybox-static)" >&2; exit 1; }
  key=$(key_of "$bb")
  archive=$OUT/busybox-$key.tar
  if [[ ! -f $archive ]]; then
    local rootfs; rootfs=$(mktemp -d "$OUT/.rootfs.XXXXXX")
    mkdir -p "$rootfs/bin" "$rootfs/tmp" "$rootfs/etc"
    cp "$bb" "$rootfs/bin/busybox"
    for a in $APPLETS; do ln -s busybox "$rootfs/bin/$a"; done
    chmod 1777 "$rootfs/tmp"
    commit_image "$BUSYBOX_IMAGE" "$archive" "$rootfs" '["/bin/sh"]'
    rm -rf "$rootfs"
  fi
  echo "$BUSYBOX_IMAGE $archive"
}

case ${1:-build} in
  build)
    command -v buildah >/dev/null || { echo "node-images: buildah is required (hack/host-packages.sh)" >&2; exit 1; }
    mkdir -p "$OUT"
    exec 9>"$OUT/.lock"; flock 9
    build_pause; build_busybox ;;
  names) echo "$PAUSE_IMAGE"; echo "$BUSYBOX_IMAGE" ;;
  *) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 2 ;;  # the header comment
esac
