"""Elastic jobs (spec.elastic) through the controller on the fake cluster: a gang that lost a node and finds
no room for all of its pods restarts on fewer after shrinkAfterSeconds, with the data-parallel degrees
shrunk; when room returns for growAfterSeconds it asks rank 0 for a checkpoint and, once that is
committed, grows back. Resizes spend no maxRestarts."""

from __future__ import annotations

from tetrad.api import contract
from tetrad.node.environment import RoundSettings

from .fakes import FakeCluster, job_body, node_body
from .test_lifecycle import FAST, cond, running

ELASTIC = {"minNodes": 2, "shrinkAfterSeconds": 30, "growAfterSeconds": 10}


def one_pod_per_node(n: int) -> list[dict]:
    return [node_body(f"n{i}", cpu="4", memory="8Gi") for i in range(n)]


def env_of(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}


def current(c: FakeCluster) -> list[dict]:
    restart = c.status["restarts"]
    return sorted((p for p in c.pods.values()
                   if p["metadata"]["labels"][contract.LABEL_RESTART] == str(restart)),
                  key=lambda p: int(p["metadata"]["labels"][contract.LABEL_RANK]))


def events(c: FakeCluster, reason: str) -> list[str]:
    return [e.message for e in c.events if e.reason == reason]


def elastic_job(**spec: object) -> dict:
    return job_body(nodes=4, **{"elastic": ELASTIC, "runPolicy": FAST,
                                "checkpoint": {"enabled": True, "path": "/ckpt"}, **spec})


def lose_a_node(c: FakeCluster) -> None:
    """Node n3 goes away with its pod; no node replaces it."""
    del c.nodes["n3"]
    for _ in range(8):
        c.tick(10)
        c.reconcile()
        if c.status["restarts"] == 1:
            return
    raise AssertionError(f"no restart after the node went: {c.status}")


def wait_for_phase(c: FakeCluster, phase: str, steps: int = 20) -> None:
    for _ in range(steps):
        c.reconcile()
        c.tick()
        if c.phase == phase:
            return
    raise AssertionError(f"not {phase}: {c.status}")


def test_a_gang_without_room_for_all_its_pods_shrinks_after_the_timeout_and_grows_back_after_a_checkpoint():
    c = FakeCluster(elastic_job(), nodes=one_pod_per_node(4))
    running(c)
    assert c.status["elastic"] == {"nodes": 4, "room": 4}
    assert c.status["mesh"] == "pp1.dpr1.dps4.cp1.tp1"

    lose_a_node(c)
    assert cond(c, "Restarting")["reason"] in ("NodeLost", "PodDeleted", "PodMissing")
    # The next gang waits for a fourth node; before shrinkAfterSeconds it keeps waiting for all 4
    for _ in range(5):
        c.reconcile()
        c.tick(4)
    assert c.status["restarts"] == 1 and len(current(c)) == 4 and not events(c, "Shrunk")
    assert c.status["elastic"]["room"] == 3

    c.tick(30)
    wait_for_phase(c, "Running")
    s = c.status
    assert (s["restarts"], s["disruptions"], s["elastic"]["nodes"], s["elastic"]["resizes"]) == (2, 1, 3, 1)
    assert s["mesh"] == "pp1.dpr1.dps3.cp1.tp1" and s["worldSize"] == 3
    assert events(c, "Shrunk") == ["room for 3 of the gang's 4 pods after 30s (spec.elastic."
                                   "shrinkAfterSeconds): restarting it on 3 of spec.nodes=4 as restart 2"]
    pods = current(c)
    assert len(pods) == 3
    shared = c.objects[("ConfigMap", "job-env")]["data"]
    assert (shared["PET_NNODES"], shared["WORLD_SIZE"]) == ("3", "3")
    assert shared["TETRAD_MESH"] == "pp=1,dp_replicate=1,dp_shard=3,cp=1,tp=1"
    # neither the lost node nor the resize spent maxRestarts: the pods may restart in place twice
    assert RoundSettings.parse(env_of(pods[0])[contract.ENV_ROUNDS]).left == FAST["maxRestarts"]

    # Room for 4 again: after growAfterSeconds rank 0 is asked for a checkpoint, then the gang grows
    c.nodes["n3"] = node_body("n3", cpu="4", memory="8Gi", since=c.now)
    c.reconcile()
    assert c.status["elastic"]["room"] == 4 and "roomSince" in c.status["elastic"]
    c.tick(11)
    c.reconcile()
    token = "grow-2-4"
    assert c.status["elastic"]["growRequest"] == token
    assert current(c)[0]["metadata"]["annotations"][contract.ANNOTATION_CHECKPOINT_NOW] == token
    c.tick(5)
    c.reconcile()
    assert c.status["restarts"] == 2, "no grow before the checkpoint is committed"
    c.job["status"]["checkpoint"] = {"step": 12, "requestCommitted": {"token": token, "step": 12}}
    c.reconcile()
    s = c.status
    assert (s["restarts"], s["elastic"]["nodes"], s["elastic"]["resizes"]) == (3, 4, 2)
    assert "growRequest" not in s["elastic"] and "roomSince" not in s["elastic"]
    # a restart without backoff, where the goodput ledger cut the shrunken gang's time running
    assert c.phase == "Restarting" and cond(c, "Restarting")["reason"] == "Grown"
    assert s["goodput"]["runningSeconds"] == 0 and s["goodput"]["settled"]["startup"] > 0
    for _ in range(3):  # the old pods go, then the new ones come at once, not after backoffSeconds=10
        c.tick(1)
        c.reconcile(admit=False)
    assert len(current(c)) == 4
    assert events(c, "Grown") == ["room for 4 of spec.nodes=4 pods for 10s: checkpoint step 12 committed; "
                                  "restarting the gang on 4 as restart 3"]
    wait_for_phase(c, "Running")
    assert len(current(c)) == 4 and c.status["mesh"] == "pp1.dpr1.dps4.cp1.tp1"
    assert c.objects[("ConfigMap", "job-env")]["data"]["PET_NNODES"] == "4"


def test_below_min_nodes_the_gang_keeps_waiting():
    c = FakeCluster(elastic_job(elastic={**ELASTIC, "minNodes": 4}), nodes=one_pod_per_node(4))
    running(c)
    lose_a_node(c)
    for _ in range(10):
        c.reconcile()
        c.tick(10)
    assert c.status["restarts"] == 1 and c.status["elastic"]["nodes"] == 4 and not events(c, "Shrunk")
    assert c.phase == "GangWaiting"


def test_a_size_the_job_cannot_run_at_is_skipped():
    """globalBatch 8 divides 4 and 2 data-parallel ranks, not 3: room for 3 shrinks the gang to 2."""
    c = FakeCluster(elastic_job(training={"globalBatch": 8}), nodes=one_pod_per_node(4))
    running(c)
    lose_a_node(c)
    wait_for_phase(c, "GangWaiting")
    c.tick(31)
    wait_for_phase(c, "Running")
    assert c.status["elastic"]["nodes"] == 2 and c.status["mesh"] == "pp1.dpr1.dps2.cp1.tp1"
    assert len(current(c)) == 2


def test_a_job_that_is_not_elastic_has_no_elastic_status_and_waits():
    body = elastic_job()
    del body["spec"]["elastic"]
    c = FakeCluster(body, nodes=one_pod_per_node(4))
    running(c)
    lose_a_node(c)
    c.tick(200)
    for _ in range(5):
        c.reconcile()
        c.tick(5)
    assert "elastic" not in c.status and len(current(c)) == 4 and c.phase == "GangWaiting"


def counting_rooms(c: FakeCluster) -> list[tuple[object, ...]]:
    """The arguments of each count of a room (GangAdmitter.room) from now on, which still counts."""
    counted: list[tuple[object, ...]] = []
    room = c.controller.admission.room

    def counting(*args: object) -> int | None:
        counted.append(args)
        return room(*args)  # type: ignore[arg-type]

    c.controller.admission.room = counting  # type: ignore[method-assign]
    return counted


def test_the_room_is_counted_only_while_a_shrink_or_a_grow_is_to_be_judged():
    c = FakeCluster(elastic_job(), nodes=one_pod_per_node(4))
    counted = counting_rooms(c)
    running(c)
    assert counted, "a gang waiting for its pods has its room counted"
    counted.clear()
    for _ in range(3):  # the whole gang runs at spec.nodes: nothing to judge, no count on a pass
        c.tick(10)
        c.reconcile()
    assert not counted and c.status["elastic"] == {"nodes": 4, "room": 4}
    lose_a_node(c)
    for _ in range(3):  # the next gang waits for a fourth node: its room is counted again
        c.reconcile()
        c.tick(4)
    assert counted and c.status["elastic"]["room"] == 3


def test_a_gang_first_seen_running_whole_has_its_room_counted_once():
    """Pods that ran before any pass saw them wait (fast nodes, a busy operator) still get a room."""
    c = FakeCluster(elastic_job(), nodes=one_pod_per_node(4))
    running(c)
    c.status["elastic"].pop("room")  # as written by a pass that never saw the gang wait
    counted = counting_rooms(c)
    for _ in range(3):
        c.tick(10)
        c.reconcile()
    assert len(counted) == 1 and c.status["elastic"] == {"nodes": 4, "room": 4}
