"""Benchmark what a pod's shape costs the control plane: 400 pods POSTed bare, until all Running.

    .venv/bin/python bench/pod_shapes.py                 # 6 rounds of each shape, 400 pods, 400 nodes
    .venv/bin/python bench/pod_shapes.py --rounds 5 --pods 200

Every pod is read and written by several clients (the scheduler binds it, kwok or the kubelet
writes its status, the operator and the controllers watch it), each decoding the whole object
with its managed fields, so on a busy control plane a larger pod is a slower one. The shapes,
each POSTed as 100 jobs of 4 pods (16 in flight, no gate, no operator), in turn in every round
(each shape first in turn: the first of a round follows the previous round's deletions):

- tetrad: the pods the renderer makes for the operator's benchmark job (tetrad.render);
- tetrad+env: the same with the job's shared environment written into every pod, as before it
  moved into the job's environment ConfigMap (envFrom);
- tetrad+init: tetrad+env with the `wait-for-master` init container the workers had before the
  wait moved into the trainer's supervisor (tetrad_trainer.rendezvous);
- minimal: one container with the same image, command and resources, what bench/peers.py gives
  JobSet and Kubeflow (their controllers add their own labels and env on top).

Prints, for each shape, the stored size of a worker pod once Running (its managed fields apart)
and the median seconds from the first POST until all are Running, each round beside it. It starts
its own cluster (hack/cluster.sh, instance `bench-shapes`), starts 400 minimal pods untimed first
(a fresh cluster's first pods are slow), and deletes the cluster at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.operator_bench import drop_namespace, namespace, post_until_running, rendered_job, rendered_pods  # noqa: E402
from bench.peers import RESOURCES, _container  # noqa: E402
from tests.cluster_fixtures import start_cluster, stop_cluster  # noqa: E402
from tests.operator.helpers import Api  # noqa: E402
from tetrad.api.contract import LABEL_JOB  # noqa: E402

CLUSTER = "bench-shapes"
Pod = dict[str, Any]


def rendered(ns: str, pods: int) -> list[Pod]:
    """The renderer's pods of pods/4 four-pod jobs, as bare pods (no gate, no owner)."""
    out = [p for j in range(pods // 4) for p in rendered_pods(f"j{j:03d}", ns, 4)]
    for p in out:
        p["metadata"].pop("ownerReferences", None)
        p["spec"].pop("schedulingGates", None)
    return out


def inline_env(pods: list[Pod]) -> list[Pod]:
    """Each pod with its job's shared environment in its own env instead of envFrom."""
    shared: dict[str, dict[str, str]] = {}  # by job, rendered once
    for p in pods:
        meta, c = p["metadata"], p["spec"]["containers"][0]
        job = meta["labels"][LABEL_JOB]
        if job not in shared:
            shared[job] = rendered_job(job, meta["namespace"], 4).environment["data"]
        del c["envFrom"]
        c["env"] = [{"name": k, "value": v} for k, v in shared[job].items()] + c["env"]
    return pods


def with_init(pods: list[Pod]) -> list[Pod]:
    """The workers' former init container: `python -m tetrad.rendezvous`, three env vars, its own
    resources."""
    for p in pods:
        trainer = p["spec"]["containers"][0]
        if p["metadata"]["labels"]["tetrad.dev/node-rank"] != "0":
            p["spec"]["initContainers"] = [{
                "name": "wait-for-master", "image": trainer["image"],
                "imagePullPolicy": trainer["imagePullPolicy"],
                "command": ["python", "-m", "tetrad.rendezvous"],
                "env": [e for e in trainer["env"]
                        if e["name"] in ("PET_MASTER_ADDR", "PET_NODE_RANK", "TETRAD_RDZV_TIMEOUT")],
                "securityContext": trainer["securityContext"],
                "resources": {"requests": {"cpu": "10m", "memory": "32Mi"},
                              "limits": {"cpu": "100m", "memory": "128Mi"}}}]
    return pods


def minimal(pods: list[Pod]) -> list[Pod]:
    return [{"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": p["metadata"]["name"], "labels": {"bench": "shapes"}},
             "spec": {"restartPolicy": "Never", "containers": [_container("node", RESOURCES)]}} for p in pods]


SHAPES: dict[str, Callable[[list[Pod]], list[Pod]]] = {
    "tetrad": lambda pods: pods, "tetrad+env": inline_env,
    "tetrad+init": lambda pods: with_init(inline_env(pods)),
    "minimal": minimal}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pods", type=int, default=400, help="pods per shape and round (a multiple of 4)")
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args()
    cluster = start_cluster(CLUSTER, {"TETRAD_NODES": str(a.pods), "TETRAD_GPUS_PER_NODE": "8"})
    try:
        api = Api(cluster.kubeconfig)
        seconds: dict[str, list[float]] = {s: [] for s in SHAPES}
        sizes: dict[str, tuple[int, int]] = {}
        namespace(api, "shapes-warm-up")  # the first pods of a new cluster start slowly: not counted
        post_until_running(api, "shapes-warm-up", minimal(rendered("shapes-warm-up", a.pods)))
        drop_namespace(api, "shapes-warm-up")
        order = list(SHAPES)
        for r in range(a.rounds):
            for shape in order[r % len(order):] + order[:r % len(order)]:  # each shape goes first in turn
                make = SHAPES[shape]
                ns = f"shapes-{shape.replace('+', '-')}-{r}"
                namespace(api, ns)
                pods = make(rendered(ns, a.pods))
                seconds[shape].append(post_until_running(api, ns, pods))
                worker = api.get(f"/api/v1/namespaces/{ns}/pods/{pods[1]['metadata']['name']}")
                managed = len(json.dumps(worker["metadata"].pop("managedFields", [])))
                sizes[shape] = (len(json.dumps(worker)), managed)
                print(f"round {r + 1}: {shape}: all {a.pods} Running in {seconds[shape][-1]:.1f}s",
                      flush=True)
                drop_namespace(api, ns)
        print(f"\n| {a.pods} pods of each shape, median of {a.rounds} | worker pod, bytes "
              "| its managed fields, bytes "
              "| all Running, s (each round) | / tetrad |")
        print("|---|---|---|---|---|")
        base = statistics.median(seconds["tetrad"])
        for shape, runs in seconds.items():
            each = " / ".join(f"{s:.1f}" for s in runs)
            print(f"| {shape} | {sizes[shape][0]:,} | {sizes[shape][1]:,} "
                  f"| {statistics.median(runs):.1f} ({each}) "
                  f"| {statistics.median(runs) / base:.2f}x |")
    finally:
        stop_cluster(CLUSTER)
    return 0


if __name__ == "__main__":
    sys.exit(main())
