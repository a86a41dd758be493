"""bench/recovery_nodes.py: the JobSet it runs has Tetrad's pods (what would make the comparison unfair or
the pods fail to start: a missing ConfigMap key, the wrong master, Tetrad's restarts in place left in)."""

from __future__ import annotations

from pathlib import Path

from bench.recovery_nodes import JOBSET_INDEX, jobset_of, the_job


def test_the_jobset_runs_tetrads_pods_with_its_own_names(tmp_path: Path) -> None:
    objects = jobset_of(the_job("ns1", tmp_path / "store"), tmp_path)
    by_kind = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    config, env = by_kind[("ConfigMap", "rec-js-config")], by_kind[("ConfigMap", "rec-js-env")]
    assert "tetrad-node.pyz" in config["binaryData"]  # the launcher the pods' command runs
    assert env["data"]["PET_MASTER_ADDR"] == env["data"]["MASTER_ADDR"] == "rec-js-node-0-0.rec-js.ns1.svc"
    assert env["data"]["PET_RDZV_ENDPOINT"] == "rec-js-node-0-0.rec-js.ns1.svc:29500"
    assert not any("rec-0.rec" in v for v in env["data"].values())
    jobset = by_kind[("JobSet", "rec-js")]
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (2, 2, "Indexed")
    pod = job["template"]["spec"]
    assert not {"hostname", "subdomain", "schedulingGates"} & set(pod)
    (container,) = pod["containers"]
    env_vars = {e["name"]: e for e in container["env"]}
    assert "TETRAD_ROUNDS" not in env_vars  # a JobSet restarts in new pods only
    rank = env_vars["PET_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert rank == f"metadata.annotations['{JOBSET_INDEX}']"
    assert container["envFrom"] == [{"configMapRef": {"name": "rec-js-env"}}]
    mounted = {v["name"]: v for v in pod["volumes"]}
    assert mounted["config"]["configMap"]["name"] == "rec-js-config"
    assert any(v.get("hostPath", {}).get("path") == str(tmp_path / "store") for v in pod["volumes"])
