"""An elastic job against a real API server, on fake nodes of its own: a lost node with no replacement
shrinks the gang after shrinkAfterSeconds; a node added back grows it after a checkpoint that rank 0 (the
trainer's own RankMetrics, scraped by the operator) says it committed."""

from __future__ import annotations

import time

import pytest
from tetrad_trainer.metrics import RankMetrics

from tetrad.api import contract

from .conftest import free_port, operator_in_thread
from .helpers import ptj, takes_pods, wait_events, wait_for, wait_running

pytestmark = pytest.mark.cluster


def test_an_elastic_gang_shrinks_onto_the_nodes_left_and_grows_back_after_a_checkpoint(api, operator_cluster,
                                                                                      namespace, pool):
    ns, port = namespace, free_port()
    taint = {"key": "tetrad.dev/test-pool", "value": ns, "effect": "NoSchedule"}
    names = pool(3, taints=[taint])
    job = ptj("el", nodes=3, cpu="6", metrics={"port": port}, training={"globalBatch": 6},
              checkpoint={"enabled": True, "path": "/ckpt"},
              elastic={"minNodes": 1, "shrinkAfterSeconds": 4, "growAfterSeconds": 2},
              template={"nodeSelector": pool.label, "tolerations": [{**taint, "operator": "Equal"}]})
    metrics = RankMetrics(port=port, rank=0, labels={}, jsonl=None)
    try:
        with operator_in_thread([ns]) as op:
            wait_for(lambda: {n.name for n in op.controller.nodes() if takes_pods(n)} >= set(names),
                     what="the operator's node view shows the pool taking pods")
            api.create_job(ns, job)
            wait_running(api, ns, "el", 3)
            assert api.status(ns, "el")["elastic"] == {"nodes": 3, "room": 3}

            api.delete(f"/api/v1/nodes/{names[2]}")  # no node replaces it
            wait_events(api, ns, "el", "Shrunk", timeout=60)
            pods = wait_running(api, ns, "el", 2, restart=2, timeout=60)
            st = api.status(ns, "el")
            assert (st["restarts"], st["disruptions"], st["elastic"]["nodes"], st["elastic"]["resizes"],
                    st["mesh"], st["worldSize"]) == (2, 1, 2, 1, "pp1.dpr1.dps2.cp1.tp1", 2)
            shared = api.get(f"/api/v1/namespaces/{ns}/configmaps/el-env")["data"]
            assert (shared["PET_NNODES"], shared["WORLD_SIZE"]) == ("2", "2")
            assert {p["spec"]["nodeName"] for p in pods} == set(names[:2])

            pool(1, taints=[taint])  # room for the third pod again
            rank0 = "el-r2-0"
            token = "grow-2-3"
            wait_for(lambda: (api.get(f"/api/v1/namespaces/{ns}/pods/{rank0}")["metadata"].get("annotations")
                              or {}).get(contract.ANNOTATION_CHECKPOINT_NOW) == token,
                     timeout=30, what="rank 0 asked for a checkpoint before the gang grows")
            assert api.status(ns, "el")["restarts"] == 2, "no grow before the checkpoint is committed"
            metrics.checkpoint_requested(token, 20)
            metrics.checkpoint_committed(20, time.time())
            wait_running(api, ns, "el", 3, restart=3, timeout=60)
            st = api.status(ns, "el")
            assert (st["elastic"]["nodes"], st["elastic"]["resizes"], st["mesh"]) == (3, 2,
                                                                          "pp1.dpr1.dps3.cp1.tp1")
            wait_events(api, ns, "el", "Grown", "checkpoint step 20 committed; restarting the gang on 3 as "
                        "restart 3")
    finally:
        metrics.close()
