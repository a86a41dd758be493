"""The renderer: golden pod env, pod shape and security, gang objects per scheduler."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.api.helpers import manifest, rendered_env
from tetrad.api import InvalidJob, parse
from tetrad.api.spec import Scheduler
from tetrad.node.environment import RoundSettings
from tetrad.render import gangs, render
from tetrad.render.gangs import gang_resources

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("TETRAD_UPDATE_GOLDEN") == "1"


def job_of(doc, uid="0b5e2d1c-aaaa-bbbb-cccc-000000000000"):
    doc["metadata"]["uid"] = uid
    job, problems = parse(doc)
    assert job is not None, problems
    return job


@pytest.mark.parametrize("restart,rank", [(0, 0), (0, 1), (3, 1)])
def test_golden_env(restart, rank):
    golden = GOLDEN / f"env-r{restart}-{rank}.yaml"
    text = yaml.safe_dump(rendered_env(render(job_of(manifest()), restart=restart), rank), sort_keys=True)
    if UPDATE:
        golden.write_text(text)
    assert text == golden.read_text(), (
        f"rendered env changed; if intended, rerun with TETRAD_UPDATE_GOLDEN=1 ({golden})")


def test_restart_changes_pod_name_and_rendezvous_id_only():
    job = job_of(manifest())
    ra, rb = render(job, restart=0), render(job, restart=1)
    a, b = ra.pods[1], rb.pods[1]
    assert (a["metadata"]["name"], b["metadata"]["name"]) == ("t-r0-1", "t-r1-1")
    assert a["spec"]["hostname"] == b["spec"]["hostname"] == "t-1"
    ea, eb = rendered_env(ra, 1), rendered_env(rb, 1)
    changed = {k for k in ea if ea[k] != eb[k]}
    assert changed == {"PET_RDZV_ID", "TETRAD_RESTART", "TETRAD_ROUNDS"}
    rounds_a, rounds_b = (RoundSettings.parse(e["TETRAD_ROUNDS"]) for e in (ea, eb))
    assert (rounds_a.restarts, rounds_b.restarts) == (0, 1)
    assert rounds_a.token != rounds_b.token, "an old gang's node cannot join the new one's rounds"
    assert ra.environment == rb.environment, "the shared environment is the same in every incarnation"


def test_the_pods_restart_in_place_through_pod_0s_coordinator_within_the_budget_they_are_given():
    job = job_of(manifest(runPolicy={"maxRestarts": 3, "retryableExitCodes": [1, 2],
                                     "permanentExitCodes": [9]}))
    fresh, later = render(job), render(job, restart=2, in_place_left=1)
    for r, left in ((fresh, 3), (later, 1)):
        settings = [RoundSettings.parse(rendered_env(r, rank)["TETRAD_ROUNDS"]) for rank in (0, 1)]
        assert settings[0] == settings[1], "every node of a gang has the same settings"
        s = settings[0]
        assert (s.host, s.port, s.left) == ("t-0.t.ns.svc", 29501, left)
        assert (s.retryable, s.permanent) == ((1, 2), (9,))
    ports = [{p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
             for pod in fresh.pods]
    assert ports[0]["rounds"] == 29501 and "rounds" not in ports[1]


def test_the_rounds_port_may_not_collide_with_the_metrics_ports():
    job = job_of(manifest(rendezvous={"port": 9399}, metrics={"port": 9400}))
    with pytest.raises(InvalidJob, match=r"spec.rendezvous.port.*the next port"):
        render(job)


def test_a_pod_carries_only_what_sets_it_apart_and_takes_the_rest_from_the_environment_configmap():
    r = render(job_of(manifest()))
    assert r.environment["metadata"]["name"] == "t-env"
    shared = r.environment["data"]
    for pod in r.pods:
        c = pod["spec"]["containers"][0]
        assert c["envFrom"] == [{"configMapRef": {"name": "t-env"}}]
        own = {e["name"] for e in c["env"]}
        assert own == {"PET_NODE_RANK", "PET_RDZV_ID", "TETRAD_RESTART", "TETRAD_ROUNDS", "POD_IP",
                       "TETRAD_NODE_NAME"}
        assert not own & set(shared), "a variable lives in one place"
    assert (shared["PET_NNODES"] == "2" and shared["WORLD_SIZE"] == "8"
            and shared["PET_MASTER_ADDR"] == "t-0.t.ns.svc")
    assert [rendered_env(r, rank)["PET_NODE_RANK"] for rank in (0, 1)] == ["0", "1"]


def test_objects_and_owner_references():
    r = render(job_of(manifest()))
    kinds = [o["kind"] for o in r.objects()]
    assert kinds == ["Service", "ConfigMap", "ConfigMap", "Pod", "Pod"]
    for o in r.objects():
        ref = o["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["name"], ref["controller"]) == ("ParallelTrainingJob", "t", True)
        assert o["metadata"]["namespace"] == "ns"
    svc = r.service["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
    # only pod 0's name is looked up
    assert svc["selector"] == {"tetrad.dev/job-name": "t", "tetrad.dev/node-rank": "0"}
    assert r.pods[0]["spec"]["subdomain"] == "t"
    assert '"pp": 2' in r.configmap["data"]["config.json"]


def test_no_owner_reference_without_uid():
    job, _ = parse(manifest())
    assert all("ownerReferences" not in o["metadata"] for o in render(job).objects())


def test_pod_security_and_volumes():
    doc = manifest(checkpoint={"enabled": True, "path": "/ckpt",
                               "volume": {"persistentVolumeClaim": {"claimName": "c"}}},
                   template={"nodeSelector": {"gpu": "h100"},
                             "tolerations": [{"key": "gpu", "operator": "Exists"}],
                             "env": [{"name": "EXTRA", "value": "1"}], "serviceAccountName": "trainer"},
                   resources={"cpu": "8", "memory": "32Gi", "gpu": 4})
    r = render(job_of(doc))
    pod = r.pods[1]
    spec, c = pod["spec"], pod["spec"]["containers"][0]
    assert (spec["securityContext"]["runAsNonRoot"]
            and spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"})
    assert (c["securityContext"]["readOnlyRootFilesystem"]
            and not c["securityContext"]["allowPrivilegeEscalation"])
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert {"/tmp", "/dev/shm", "/etc/tetrad", "/ckpt"} <= set(mounts)
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["checkpoints"]["persistentVolumeClaim"] == {"claimName": "c"}
    assert c["resources"]["limits"] == {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": 4}
    assert spec["nodeSelector"] == {"gpu": "h100"} and spec["serviceAccountName"] == "trainer"
    assert rendered_env(r, 1)["EXTRA"] == "1"
    assert spec["restartPolicy"] == "Never"
    assert c["command"] == ["python3", "/etc/tetrad/tetrad-node.pyz", "supervise", "--", "python3", "-m",
                            "torch.distributed.run", "/etc/tetrad/tetrad-node.pyz", "worker", "--trainer",
                            "--", "--config", "/etc/tetrad/config.json"]
    assert rendered_env(r, 1)["PET_SHUTDOWN_TIMEOUT"] == "110"  # the default 120 s grace period less 10 s
    assert "initContainers" not in spec  # a worker waits for the master inside the supervisor


def test_builtin_gang_gates_every_pod():
    r = render(job_of(manifest()))
    assert all(p["spec"]["schedulingGates"] == [{"name": "tetrad.dev/gang"}] for p in r.pods)
    assert r.pod_group is None


def test_volcano_pod_group():
    r = render(job_of(manifest(gang={"scheduler": "volcano", "queue": "research"},
                               resources={"cpu": "4", "memory": "16Gi", "gpu": 4})))
    pg = r.pod_group
    assert pg["apiVersion"] == "scheduling.volcano.sh/v1beta1" and pg["kind"] == "PodGroup"
    assert pg["spec"] == {"minMember": 2,
                          "minResources": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "8"},
                          "queue": "research"}
    for p in r.pods:
        assert p["spec"]["schedulerName"] == "volcano"
        assert p["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "t"
        assert "schedulingGates" not in p["spec"]


def test_coscheduling_pod_group_per_incarnation():
    job = job_of(
        manifest(gang={"scheduler": "coscheduling", "timeoutSeconds": 60}, resources={"cpu": "500m"}))
    for restart in (0, 3):
        r = render(job, restart=restart)
        assert r.pod_group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
        assert r.pod_group["metadata"]["name"] == f"t-r{restart}"
        assert r.pod_group["metadata"]["labels"]["tetrad.dev/restart"] == str(restart)
        assert r.pod_group["spec"] == {"minMember": 2, "minResources": {"cpu": "1000m"},
                                       "scheduleTimeoutSeconds": 60}
        assert all(
            p["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == f"t-r{restart}" for p in r.pods)


def test_kueue_labels():
    r = render(job_of(manifest(gang={"scheduler": "kueue", "queue": "team-a"})))
    for p in r.pods:
        assert p["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == "t"
        assert p["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "2"
        assert p["metadata"]["annotations"]["kueue.x-k8s.io/role-hash"] == "trainer"  # one podset


def test_every_gang_scheduler_has_its_backend():
    assert set(gangs.BACKENDS) == set(Scheduler)
    assert all(scheduler == backend.scheduler for scheduler, backend in gangs.BACKENDS.items())


def test_gang_resources_sum_quantities():
    job = job_of(manifest(resources={"cpu": "1.5", "memory": "512Mi"}))
    assert gang_resources(job.spec) == {"cpu": "3", "memory": "1024Mi"}


def test_workload_gang_per_incarnation():
    """gang.scheduler=workload: a Workload and its PodGroup per incarnation, named by every pod."""
    r = render(job_of(manifest(gang={"scheduler": "workload"})), restart=3)
    wl, pg = r.workload, r.pod_group
    assert [o["kind"] for o in r.gang_objects()] == ["Workload", "PodGroup"]  # the Workload first
    for o in (wl, pg):
        assert o["apiVersion"] == "scheduling.k8s.io/v1alpha2" and o["metadata"]["name"] == "t-r3"
        assert o["metadata"]["labels"] == {"tetrad.dev/job-name": "t", "tetrad.dev/restart": "3"}
        assert o["metadata"]["ownerReferences"][0]["kind"] == "ParallelTrainingJob"
    assert wl["spec"] == {
        "controllerRef": {"apiGroup": "tetrad.dev", "kind": "ParallelTrainingJob", "name": "t"},
        "podGroupTemplates": [{"name": "workers", "schedulingPolicy": {"gang": {"minCount": 2}}}]}
    assert pg["spec"] == {
        "podGroupTemplateRef": {"workload": {"workloadName": "t-r3", "podGroupTemplateName": "workers"}},
        "schedulingPolicy": {"gang": {"minCount": 2}}}
    for p in r.pods:
        assert p["spec"]["schedulingGroup"] == {"podGroupName": "t-r3"}
        assert "schedulingGates" not in p["spec"] and "schedulerName" not in p["spec"]
    assert r.objects().index(wl) < r.objects().index(pg)


def stage_terms(pod, kind="requiredDuringSchedulingIgnoredDuringExecution"):
    return pod["spec"].get("affinity", {}).get("podAffinity", {}).get(kind, [])


def test_topology_key_keeps_each_pipeline_stage_in_one_domain():
    """pp=2 over 4 pods: pods 0-1 are stage 0 and pods 2-3 stage 1; each stage's pods attract each
    other within one rack. A user's own pod affinity stays."""
    own = {"labelSelector": {"matchLabels": {"app": "cache"}}, "topologyKey": "kubernetes.io/hostname"}
    doc = manifest(nodes=4, parallelism={"pp": 2, "dpShard": 4, "tp": 2},
                   gang={"scheduler": "workload", "topologyKey": "tetrad.dev/rack"},
                   template={"affinity": {
                       "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [own]}}})
    r = render(job_of(doc), restart=1)
    assert "schedulingConstraints" not in r.pod_group["spec"]  # the gang spans racks; its stages do not
    stages = [p["metadata"]["labels"]["tetrad.dev/pipeline-stage"] for p in r.pods]
    assert stages == ["0", "0", "1", "1"]
    for p, stage in zip(r.pods, stages, strict=True):
        assert stage_terms(p) == [own, {"labelSelector": {"matchLabels": {
            "tetrad.dev/job-name": "t", "tetrad.dev/restart": "1", "tetrad.dev/pipeline-stage": stage}},
            "topologyKey": "tetrad.dev/rack"}]
        # and it prefers a domain without the other stages' pods
        (apart,) = p["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert apart["podAffinityTerm"]["labelSelector"]["matchExpressions"] == [
            {"key": "tetrad.dev/pipeline-stage", "operator": "NotIn", "values": [stage]}]
    preferred = render(job_of(manifest(nodes=4, parallelism={"pp": 2, "dpShard": 4, "tp": 2},
                                       gang={"topologyKey": "tetrad.dev/rack", "topologyMode": "Preferred"})))
    (term,) = stage_terms(preferred.pods[3], "preferredDuringSchedulingIgnoredDuringExecution")
    assert term["weight"] == 100 and term["podAffinityTerm"]["topologyKey"] == "tetrad.dev/rack"
    assert not stage_terms(preferred.pods[3])


def test_stage_of_a_pod_is_the_stage_of_its_first_rank():
    # 3 pods x 2 processes, pp=3: one stage per pod; 2 pods x 4, pp=4: two stages per pod.
    three = render(job_of(manifest(nodes=3, nprocPerNode=2, parallelism={"pp": 3, "dpShard": 2, "tp": 1},
                                   gang={"topologyKey": "tetrad.dev/rack"}, training={"globalBatch": 6})))
    assert [p["metadata"]["labels"]["tetrad.dev/pipeline-stage"] for p in three.pods] == ["0", "1", "2"]
    four = render(job_of(
        manifest(parallelism={"pp": 4, "dpShard": 1, "tp": 2}, gang={"topologyKey": "tetrad.dev/rack"})))
    assert [p["metadata"]["labels"]["tetrad.dev/pipeline-stage"] for p in four.pods] == ["0", "2"]


def test_topology_of_a_single_stage_goes_to_the_schedulers_own_field():
    """pp=1: the stage is the whole gang, so the scheduler's whole-group topology carries it."""
    one_stage = {"nodes": 4, "parallelism": {"pp": 1, "dpShard": 8, "tp": 2}}
    wl = render(
        job_of(manifest(**one_stage, gang={"scheduler": "workload", "topologyKey": "tetrad.dev/rack"})))
    for o in wl.gang_objects():
        (template,) = o["spec"]["podGroupTemplates"] if o["kind"] == "Workload" else [o["spec"]]
        assert template["schedulingConstraints"] == {"topology": [{"key": "tetrad.dev/rack"}]}
    assert not any(stage_terms(p) for p in wl.pods)
    kueue = render(job_of(manifest(**one_stage, gang={"scheduler": "kueue", "queue": "q",
                                                      "topologyKey": "tetrad.dev/rack",
                                                      "topologyMode": "Preferred"})))
    assert all(p["metadata"]["annotations"]["kueue.x-k8s.io/podset-preferred-topology"] == "tetrad.dev/rack"
               and "affinity" not in p["spec"] for p in kueue.pods)
    volcano = render(
        job_of(manifest(**one_stage, gang={"scheduler": "volcano", "topologyKey": "tetrad.dev/rack"})))
    assert volcano.pod_group["spec"]["networkTopology"] == {"mode": "hard", "highestTierAllowed": 1}
    # The Workload API's topology has no preferred form: a preferred pod affinity instead.
    soft = render(job_of(manifest(**one_stage, gang={"scheduler": "workload",
                                                     "topologyKey": "tetrad.dev/rack",
                                                     "topologyMode": "Preferred"})))
    assert "schedulingConstraints" not in soft.pod_group["spec"]
    assert stage_terms(soft.pods[0], "preferredDuringSchedulingIgnoredDuringExecution")
    assert "podAntiAffinity" not in soft.pods[0]["spec"]["affinity"]  # one stage: no other stage to avoid


def test_kueue_pipeline_stages_are_podset_slices():
    r = render(job_of(manifest(nodes=4, parallelism={"pp": 2, "dpShard": 4, "tp": 2},
                               gang={"scheduler": "kueue", "queue": "q", "topologyKey": "tetrad.dev/rack"})))
    for p in r.pods:
        ann = p["metadata"]["annotations"]
        assert ann["kueue.x-k8s.io/podset-slice-required-topology"] == "tetrad.dev/rack"
        assert ann["kueue.x-k8s.io/podset-slice-size"] == "2"
        assert "kueue.x-k8s.io/podset-required-topology" not in ann


def test_tp_and_cp_groups_stay_inside_one_pod_and_stage_labels_follow_the_mesh():
    """The trainer's mesh is init_device_mesh(layout.shape, MESH_DIMS): global ranks row-major, tp
    innermost, and pod k runs ranks k*nproc .. (k+1)*nproc-1. With cp*tp dividing nprocPerNode every
    TP and CP group is inside one pod, and each pod's stage label is its first rank's pp coordinate."""
    import itertools

    from tetrad.api.resolved import MESH_DIMS

    r = render(job_of(manifest(nodes=4, nprocPerNode=8, parallelism={"pp": 2, "dpShard": 4, "cp": 2, "tp": 2},
                               gang={"topologyKey": "tetrad.dev/rack"}, training={"globalBatch": 8},
                               model={"seqLen": 64})))
    cfg = r.config
    coords = list(itertools.product(*(range(d) for d in cfg.layout.shape)))  # index = global rank
    for dim in ("cp", "tp"):
        axis = MESH_DIMS.index(dim)
        groups: dict[tuple[int, ...], set[int]] = {}
        for rank, coord in enumerate(coords):
            groups.setdefault(coord[:axis] + coord[axis + 1:], set()).add(rank // cfg.nproc_per_node)
        assert len(groups) == cfg.world_size // getattr(cfg.layout, dim)
        assert all(len(pods) == 1 for pods in groups.values()), dim
    pp = MESH_DIMS.index("pp")
    assert [p["metadata"]["labels"]["tetrad.dev/pipeline-stage"] for p in r.pods] == \
        [str(coords[k * cfg.nproc_per_node][pp]) for k in range(4)] == ["0", "0", "1", "1"]
