"""hack/images/thin-archive.py on synthetic OCI layouts: a thin archive holds the image's own blobs and names
the base's layers as the base's archive does; an image not built on the base is refused. Against the real
thing (buildah, the nodes' containerd), tests/e2e/test_bring_your_own.py runs the examples' images."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

from tests.cluster_fixtures import REPO

SCRIPT = REPO / "hack" / "images" / "thin-archive.py"


def put(layout: Path, data: bytes) -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    path = layout / "blobs" / "sha256" / digest.split(":")[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"mediaType": "application/octet-stream", "digest": digest, "size": len(data)}


def image(layout: Path, layers: list[dict[str, Any]], diff_ids: list[str]) -> dict[str, Any]:
    """An OCI layout of one image: `layers` (descriptors, blobs written or not) over `diff_ids`."""
    config = put(layout, json.dumps({"rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode())
    manifest = put(layout, json.dumps({"schemaVersion": 2, "config": config, "layers": layers}).encode())
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [manifest]}))
    return manifest


def archive_of(layout: Path, out: Path) -> Path:
    with tarfile.open(out, "w") as tar:
        for path in sorted(layout.rglob("*")):
            if path.is_file():
                tar.add(path, str(path.relative_to(layout)))
    return out


def thin(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_a_thin_archive_holds_only_the_images_own_blobs_and_names_the_bases_layers(tmp_path: Path) -> None:
    base_layout = tmp_path / "base"
    torch_layer, tetrad_layer = (put(base_layout, b"torch, compressed"),
                                 put(base_layout, b"tetrad, compressed"))
    image(base_layout, [torch_layer, tetrad_layer], ["sha256:torch", "sha256:tetrad"])
    base = archive_of(base_layout, tmp_path / "base.tar")

    pushed = tmp_path / "pushed"
    assert thin("placeholders", str(base), str(pushed)).returncode == 0
    placeholder = pushed / "blobs" / "sha256" / "torch"  # what buildah finds and skips
    assert placeholder.exists() and placeholder.stat().st_size == 0
    # An example FROM the torch part of the base (the Dockerfile's `torch` target), with a layer of its own.
    own = put(pushed, b"train.py")
    image(pushed, [{"digest": "sha256:torch", "size": 0}, own], ["sha256:torch", "sha256:train-py"])
    out = tmp_path / "thin.tar"
    assert thin("pack", str(base), str(pushed), str(out)).returncode == 0

    with tarfile.open(out) as tar:
        names = set(tar.getnames())
        (entry,) = json.load(tar.extractfile("index.json"))["manifests"]  # type: ignore[arg-type]
        manifest_blob = tar.extractfile("blobs/sha256/" + entry["digest"].split(":")[1]).read()  # type: ignore[union-attr]
    manifest = json.loads(manifest_blob)
    assert (entry["digest"] == "sha256:" + hashlib.sha256(manifest_blob).hexdigest()
            and entry["size"] == len(manifest_blob))
    assert manifest["layers"] == [torch_layer, own]  # the shared layer as the base's archive names it
    blobs = {name.rsplit("/", 1)[1] for name in names if name.startswith("blobs/")}
    config = manifest["config"]["digest"].split(":")[1]
    # nothing of the base
    assert blobs == {entry["digest"].split(":")[1], config, own["digest"].split(":")[1]}


def test_an_image_not_built_on_the_base_is_refused(tmp_path: Path) -> None:
    base_layout = tmp_path / "base"
    image(base_layout, [put(base_layout, b"torch")], ["sha256:torch"])
    base = archive_of(base_layout, tmp_path / "base.tar")
    other = tmp_path / "other"
    image(other, [put(other, b"debian")], ["sha256:debian"])
    result = thin("pack", str(base), str(other), str(tmp_path / "thin.tar"))
    assert result.returncode != 0 and "is not built on the image of" in result.stderr, result
    assert not (tmp_path / "thin.tar").exists()
