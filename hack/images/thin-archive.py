"""Write an image built FROM one of Tetrad's images as a thin OCI archive: only the blobs its base lacks.

An example's image (examples/bring-your-own/*/Dockerfile) starts with the trainer's 6 GB of layers; a
full archive would copy and compress them again for every example and every node. A thin archive
carries the image's manifest, its config and its own layers, and names the base's layers as the base's
archive does, so a containerd that has imported the base's archive (hack/cluster.sh load, in that order)
has every blob it needs and unpacks nothing twice.

    thin-archive.py placeholders BASE.tar LAYOUT   empty files for the base's layers in an OCI layout, so
                                                  that `buildah push IMAGE oci:LAYOUT` skips them
    thin-archive.py pack BASE.tar LAYOUT OUT.tar   the thin archive of the one image pushed to LAYOUT
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path
from typing import Any


def digest_path(digest: str) -> str:
    algorithm, hexdigest = digest.split(":", 1)
    return f"blobs/{algorithm}/{hexdigest}"


def base_image(archive: Path) -> tuple[dict[str, Any], list[str]]:
    """The base archive's (one) manifest and its layers' uncompressed digests."""
    with tarfile.open(archive) as tar:
        def blob(digest: str) -> Any:
            member = tar.extractfile(digest_path(digest))
            assert member is not None, f"{archive}: no blob {digest}"
            return json.load(member)
        index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
        manifest = blob(index["manifests"][0]["digest"])
        return manifest, blob(manifest["config"]["digest"])["rootfs"]["diff_ids"]


def placeholders(base: Path, layout: Path) -> None:
    """An OCI layout in which every layer of the base seems present, under both the digest of its
    archive's blob and its uncompressed digest (the one buildah's store knows a layer it built by)."""
    manifest, diff_ids = base_image(base)
    for digest in [layer["digest"] for layer in manifest["layers"]] + diff_ids:
        path = layout / digest_path(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()


def pack(base: Path, layout: Path, out: Path) -> None:
    base_manifest, base_diff_ids = base_image(base)
    index = json.loads((layout / "index.json").read_text())
    (entry,) = index["manifests"]
    manifest = json.loads((layout / digest_path(entry["digest"])).read_text())
    diff_ids = json.loads(
        (layout / digest_path(manifest["config"]["digest"])).read_text())["rootfs"]["diff_ids"]
    shared = 0
    while shared < min(len(diff_ids), len(base_diff_ids)) and diff_ids[shared] == base_diff_ids[shared]:
        shared += 1
    if shared == 0:
        sys.exit(f"thin-archive: the image in {layout} is not built on the image of {base}")
    # The layers it shares with the base are named as the base's archive names them (a compression
    # of the same content); the rest travel in the archive.
    manifest["layers"][:shared] = base_manifest["layers"][:shared]
    manifest_bytes = json.dumps(manifest, separators=(",", ":")).encode()
    entry.update(digest="sha256:" + hashlib.sha256(manifest_bytes).hexdigest(), size=len(manifest_bytes))
    own = [manifest["config"]["digest"]] + [layer["digest"] for layer in manifest["layers"][shared:]]
    with tarfile.open(out, "w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
        add("oci-layout", (layout / "oci-layout").read_bytes())
        add("index.json", json.dumps(index).encode())
        add(digest_path(entry["digest"]), manifest_bytes)
        for digest in own:
            tar.add(layout / digest_path(digest), digest_path(digest))


if __name__ == "__main__":
    match sys.argv[1:]:
        case ["placeholders", base, layout]:
            placeholders(Path(base), Path(layout))
        case ["pack", base, layout, out]:
            pack(Path(base), Path(layout), Path(out))
        case _:
            sys.exit(__doc__)
