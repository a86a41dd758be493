"""A Hugging Face directory the CLI can read (part of the CLI layer): where `spec.model.hfDir` exists on
this machine, `tetrad validate | plan | render | run` take the family and dims from its config.json
(tetrad.resolve.model_from_hf); `tetrad model DIR` prints them as the spec.model of a manifest for a
cluster, which cannot read the directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tetrad.api import ParallelTrainingJob, Problem
from tetrad.api.families import HFModel, read_hf_config
from tetrad.api.manifest import shorten
from tetrad.resolve import model_from_hf, preset_of

CONFIG = "config.json"
MAX_CONFIG_BYTES = 1 << 20


class HFDirError(ValueError):
    """The directory's config.json cannot be read; the message says why."""


def read_config(hf_dir: Path) -> dict[str, Any]:
    path = hf_dir / CONFIG
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise HFDirError(f"{shorten(str(path), 200)}: cannot read: {e.strerror or e}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise HFDirError(f"{shorten(str(path), 200)}: larger than {MAX_CONFIG_BYTES} bytes,"
                         " not a model config")
    try:
        config = json.loads(data)
    except ValueError as e:
        raise HFDirError(f"{shorten(str(path), 200)}: not JSON: {e}") from None
    if not isinstance(config, dict):
        raise HFDirError(f"{shorten(str(path), 200)}: not a JSON object")
    return config


def with_local_hf_dir(job: ParallelTrainingJob) -> tuple[ParallelTrainingJob, list[Problem]]:
    """The job with spec.model filled from its hfDir's config.json where that file is on this machine; as it
    is (no problem) where it is not, as in the cluster."""
    hf_dir = job.spec.model.hf_dir
    if hf_dir is None or not (Path(hf_dir) / CONFIG).is_file():
        return job, []
    try:
        config = read_config(Path(hf_dir))
    except HFDirError as e:
        return job, [Problem("spec.model.hfDir", str(e))]
    spec, problems = model_from_hf(job.spec, read_hf_config(config), f"{hf_dir}/{CONFIG}")
    return job.model_copy(update={"spec": spec}), problems


def describe(hf_dir: Path) -> tuple[HFModel, str]:
    """The directory's model and the YAML of spec.model for it (its preset when one has its dims)."""
    hf = read_hf_config(read_config(hf_dir))
    if hf.problems:
        return hf, ""
    preset = preset_of(hf)
    model: dict[str, Any] = {"preset": preset} if preset else dict(hf.fields)
    if not preset:
        model["seqLen"] = min(hf.max_positions or 4096, 4096)
    model["hfDir"] = "/models/<the directory in the pod>"
    import yaml

    return hf, yaml.safe_dump({"model": model}, sort_keys=False)
