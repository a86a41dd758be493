"""SIGKILL the operator at random points during creation and restarts; the cluster state alone
must let the next operator carry on: no duplicate or orphaned pods, and the job completes."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from tetrad.api import contract
from tetrad.render import names

from .conftest import operator_process
from .helpers import finish_all, ptj, terminate, wait_for, wait_phase

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NODES = 12
KILLS = int(os.environ.get("TETRAD_CHAOS_KILLS", "20"))


def check_invariants(api, ns: str, uid: str) -> None:
    status = api.status(ns, "chaos")
    recorded = status.get("restarts", 0)
    pods = api.pods(ns, "chaos")
    live_restarts = set()
    per_restart: dict[str, int] = {}
    for p in pods:
        meta = p["metadata"]
        restart, rank = int(meta["labels"][contract.LABEL_RESTART]), int(meta["labels"][contract.LABEL_RANK])
        assert meta["name"] == names.pod("chaos", restart, rank)
        assert [r["uid"] for r in meta.get("ownerReferences", [])] == [uid], (
            f"orphan or foreign pod {meta['name']}")
        assert 0 <= rank < NODES
        # The status is written before a new gang is created, so pods never run ahead of it.
        assert restart <= recorded, f"pod {meta['name']} ahead of status.restarts={recorded}"
        per_restart[meta["labels"][contract.LABEL_RESTART]] = per_restart.get(
            meta["labels"][contract.LABEL_RESTART], 0) + 1
        if not meta.get("deletionTimestamp") and p["status"].get("phase") in ("Pending", "Running"):
            live_restarts.add(restart)
    assert len(live_restarts) <= 1, f"two gangs alive at once: {live_restarts}"
    assert all(n <= NODES for n in per_restart.values()), per_restart


def test_sigkill_at_random_points_never_duplicates_or_orphans(api, operator_cluster, namespace, tmp_path):
    ns = namespace
    seed = int(os.environ.get("TETRAD_CHAOS_SEED", str(time.time_ns() % 100000)))
    rng = random.Random(seed)
    print(f"chaos seed {seed}")
    job = api.create_job(ns, ptj("chaos", nodes=NODES, cpu="100m",
                                 runPolicy={"maxRestarts": 100, "backoffSeconds": 0, "backoffMaxSeconds": 1}))
    uid = job["metadata"]["uid"]
    log = tmp_path / "operator.log"
    failed_incarnations: set[int] = set()
    for kill in range(KILLS):
        proc = operator_process(ns, kubeconfig=operator_cluster.kubeconfig, log=log)
        try:
            if kill % 3 != 0:
                # Fail a pod of the current gang so that this kill lands in the middle of a restart.
                running = [p for p in api.pods(ns, "chaos") if p["status"].get("phase") == "Running"
                           and not p["metadata"].get("deletionTimestamp")]
                if running:
                    victim = rng.choice(running)
                    terminate(api, ns, victim["metadata"]["name"], 1)
                    failed_incarnations.add(int(victim["metadata"]["labels"][contract.LABEL_RESTART]))
            time.sleep(rng.uniform(1.0, 4.0))  # the operator starts in ~1-2 s, then creates / restarts
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        check_invariants(api, ns, uid)
        st = api.status(ns, "chaos")
        by_restart: dict[str, int] = {}
        for p in api.pods(ns, "chaos"):
            key = f"r{p['metadata']['labels'][contract.LABEL_RESTART]}:{p['status'].get('phase')}"
            by_restart[key] = by_restart.get(key, 0) + 1
        print(f"kill {kill + 1}: {st.get('phase')} restarts={st.get('restarts')} pods={by_restart}")

    proc = operator_process(ns, kubeconfig=operator_cluster.kubeconfig, log=log)
    try:
        def settled():
            st = api.status(ns, "chaos")
            r = st.get("restarts", 0)
            live = [p for p in api.pods(ns, "chaos") if p["status"].get("phase") == "Running"
                    and p["metadata"]["labels"][contract.LABEL_RESTART] == str(r)]
            return st.get("phase") == "Running" and len(live) == NODES
        wait_for(settled, timeout=90, what="the job running again after the chaos")
        finish_all(api, ns, "chaos", 0)
        st = wait_phase(api, ns, "chaos", "Succeeded", timeout=60)
        check_invariants(api, ns, uid)
        # Every gang incarnation that had a failure was restarted exactly once.
        assert st["restarts"] == len(failed_incarnations), (st["restarts"], failed_incarnations)
        pods = api.pods(ns, "chaos")
        assert sorted(p["metadata"]["name"] for p in pods) == sorted(names.pod("chaos", st["restarts"], r)
                                                                     for r in range(NODES))
        assert all(p["status"]["phase"] == "Succeeded" for p in pods)
    finally:
        proc.terminate()
        proc.wait(30)
    assert "Traceback" not in log.read_text(), log.read_text()[-4000:]
