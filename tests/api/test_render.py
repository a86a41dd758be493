"""The renderer: golden pod env, pod shape and security, gang objects per scheduler."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.api.helpers import manifest
from tetrad.api import parse
from tetrad.render import render
from tetrad.render.gang import gang_resources

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("TETRAD_UPDATE_GOLDEN") == "1"


def job_of(doc, uid="0b5e2d1c-aaaa-bbbb-cccc-000000000000"):
    doc["metadata"]["uid"] = uid
    job, problems = parse(doc)
    assert job is not None, problems
    return job


def env_of(pod):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize("restart,rank", [(0, 0), (0, 1), (3, 1)])
def test_golden_env(restart, rank):
    pod = render(job_of(manifest()), restart=restart).pods[rank]
    golden = GOLDEN / f"env-r{restart}-{rank}.yaml"
    text = yaml.safe_dump(env_of(pod), sort_keys=True)
    if UPDATE:
        golden.write_text(text)
    assert text == golden.read_text(), f"rendered env changed; if intended, rerun with TETRAD_UPDATE_GOLDEN=1 ({golden})"


def test_restart_changes_pod_name_and_rendezvous_id_only():
    job = job_of(manifest())
    a, b = render(job, restart=0).pods[1], render(job, restart=1).pods[1]
    assert (a["metadata"]["name"], b["metadata"]["name"]) == ("t-r0-1", "t-r1-1")
    assert a["spec"]["hostname"] == b["spec"]["hostname"] == "t-1"
    ea, eb = env_of(a), env_of(b)
    changed = {k for k in ea if ea[k] != eb[k]}
    assert changed == {"PET_RDZV_ID", "TETRAD_RESTART"}


def test_objects_and_owner_references():
    r = render(job_of(manifest()))
    kinds = [o["kind"] for o in r.objects()]
    assert kinds == ["Service", "ConfigMap", "Pod", "Pod"]
    for o in r.objects():
        ref = o["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["name"], ref["controller"]) == ("ParallelTrainingJob", "t", True)
        assert o["metadata"]["namespace"] == "ns"
    svc = r.service["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
    assert svc["selector"] == {"tetrad.dev/job-name": "t"}
    assert r.pods[0]["spec"]["subdomain"] == "t"
    assert '"pp": 2' in r.configmap["data"]["config.json"]


def test_no_owner_reference_without_uid():
    job, _ = parse(manifest())
    assert all("ownerReferences" not in o["metadata"] for o in render(job).objects())


def test_pod_security_and_volumes():
    doc = manifest(checkpoint={"enabled": True, "path": "/ckpt", "volume": {"persistentVolumeClaim": {"claimName": "c"}}},
                   template={"nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
                             "env": [{"name": "EXTRA", "value": "1"}], "serviceAccountName": "trainer"},
                   resources={"cpu": "8", "memory": "32Gi", "gpu": 4})
    pod = render(job_of(doc)).pods[1]
    spec, c = pod["spec"], pod["spec"]["containers"][0]
    assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"]["readOnlyRootFilesystem"] and not c["securityContext"]["allowPrivilegeEscalation"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert {"/tmp", "/dev/shm", "/etc/tetrad", "/ckpt"} <= set(mounts)
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["checkpoints"]["persistentVolumeClaim"] == {"claimName": "c"}
    assert c["resources"]["limits"] == {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": 4}
    assert spec["nodeSelector"] == {"gpu": "h100"} and spec["serviceAccountName"] == "trainer"
    assert env_of(pod)["EXTRA"] == "1"
    assert spec["restartPolicy"] == "Never"
    assert c["command"] == ["python", "-m", "tetrad_trainer.preemption", "torchrun", "-m", "tetrad_trainer.train",
                            "--config", "/etc/tetrad/config.json"]
    assert env_of(pod)["PET_SHUTDOWN_TIMEOUT"] == "110"  # the default 120 s grace period less 10 s
    assert spec["initContainers"][0]["command"] == ["python", "-m", "tetrad.rendezvous"]
    assert render(job_of(doc)).pods[0]["spec"]["initContainers"] == []


def test_builtin_gang_gates_every_pod():
    r = render(job_of(manifest()))
    assert all(p["spec"]["schedulingGates"] == [{"name": "tetrad.dev/gang"}] for p in r.pods)
    assert r.pod_group is None


def test_volcano_pod_group():
    r = render(job_of(manifest(gang={"scheduler": "volcano", "queue": "research"}, resources={"cpu": "4", "memory": "16Gi", "gpu": 4})))
    pg = r.pod_group
    assert pg["apiVersion"] == "scheduling.volcano.sh/v1beta1" and pg["kind"] == "PodGroup"
    assert pg["spec"] == {"minMember": 2, "minResources": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "8"}, "queue": "research"}
    for p in r.pods:
        assert p["spec"]["schedulerName"] == "volcano"
        assert p["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "t"
        assert "schedulingGates" not in p["spec"]


def test_coscheduling_pod_group():
    r = render(job_of(manifest(gang={"scheduler": "coscheduling", "timeoutSeconds": 60}, resources={"cpu": "500m"})))
    assert r.pod_group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert r.pod_group["spec"] == {"minMember": 2, "minResources": {"cpu": "1000m"}, "scheduleTimeoutSeconds": 60}
    assert all(p["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "t" for p in r.pods)


def test_kueue_labels():
    r = render(job_of(manifest(gang={"scheduler": "kueue", "queue": "team-a"})))
    for p in r.pods:
        assert p["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == "t"
        assert p["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "2"


def test_gang_resources_sum_quantities():
    job = job_of(manifest(resources={"cpu": "1.5", "memory": "512Mi"}))
    assert gang_resources(job.spec) == {"cpu": "3", "memory": "1024Mi"}
