"""Checkpoint storage in Kubernetes: the resumable example renders pods that mount its claim at the
checkpoint path, give the trainer its grace period and restart count, and agree with the claim."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tetrad.api import parse
from tetrad.render import render
from tetrad.render.objects import RUN_AS_USER

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "resumable-pvc.yaml"
CLAIM = ROOT / "examples" / "volumes" / "checkpoints-pvc.yaml"


def load_job():
    job, problems = parse(yaml.safe_load(EXAMPLE.read_text()))
    assert job is not None, problems
    return job


def test_every_pod_mounts_the_claim_at_the_checkpoint_path():
    job = load_job()
    rendered = render(job, restart=3)
    claim = yaml.safe_load(CLAIM.read_text())
    assert len(rendered.pods) == 2
    for pod in rendered.pods:
        spec = pod["spec"]
        volume = next(v for v in spec["volumes"] if v["name"] == "checkpoints")
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        trainer = spec["containers"][0]
        mount = next(m for m in trainer["volumeMounts"] if m["name"] == "checkpoints")
        assert mount["mountPath"] == "/checkpoints" and not mount.get("readOnly")
        assert (spec["terminationGracePeriodSeconds"] == job.spec.run_policy.termination_grace_period_seconds
                == 120)
        assert spec["securityContext"]["fsGroup"] == RUN_AS_USER  # the volume is writable by the trainer
        env = {e["name"]: e.get("value") for e in trainer["env"]}
        assert env["TETRAD_RESTART"] == "3"


def test_the_trainer_config_points_at_the_mount():
    rendered = render(load_job())
    config = json.loads(next(iter(rendered.configmap["data"].values())))
    ckpt = config["checkpoint"]
    assert ckpt["enabled"] and ckpt["resume"] and ckpt["async"] and ckpt["path"] == "/checkpoints"
    assert ckpt["keepLast"] == 3 and ckpt["interval"] == 25


def test_a_multi_node_job_gets_a_shared_claim():
    # Every node writes its shards into the same directory: the claim must be ReadWriteMany.
    assert load_job().spec.nodes > 1
    assert yaml.safe_load(CLAIM.read_text())["spec"]["accessModes"] == ["ReadWriteMany"]


def test_without_a_volume_nothing_is_mounted_at_the_path():
    doc = yaml.safe_load(EXAMPLE.read_text())
    del doc["spec"]["checkpoint"]["volume"]
    job, problems = parse(doc)
    assert job is not None, problems
    for pod in render(job).pods:
        assert all(v["name"] != "checkpoints" for v in pod["spec"]["volumes"])
        assert all(m["mountPath"] != "/checkpoints" for m in pod["spec"]["containers"][0]["volumeMounts"])
