"""The controller's reads and writes, on the in-memory Kubernetes (memory_kube.MemoryKube): the
objects it applies, the status it writes (through its model, or refused), and the informer's watch.
tests/operator/test_cluster_objects.py and test_cluster_informer.py check the same against a real
API server."""

from __future__ import annotations

import asyncio
import json

import pytest
from tetrad_operator import scrape, status
from tetrad_operator.informer import Informer
from tetrad_operator.kubeapi import ApiError, path
from tetrad_operator.observed import NodeState

from tetrad.api import contract
from tetrad.api.spec import TrainerAccount, TrainerTimeStatus

from .fakes import EXTRA_LABEL, T0, FakeCluster, job_body, node_body, older_renderer
from .memory_kube import MemoryKube
from .test_lifecycle import running

JOB = path(contract.API_VERSION, contract.PLURAL, "ns", "j")


def test_a_field_the_operator_stops_rendering_leaves_the_object(monkeypatch):
    extra = older_renderer(monkeypatch)  # the renderer of an older operator version, then of this one
    c = FakeCluster(job_body(nodes=2, runPolicy={"backoffSeconds": 1, "maxRestarts": 2}))
    running(c)
    c.objects[("Service", "job")]["metadata"]["annotations"] = {"someone": "else"}  # another writer's field
    assert c.objects[("ConfigMap", "job-config")]["data"]["extra.json"] == "{}"
    ports = [p["name"] for p in c.objects[("Service", "job")]["spec"]["ports"]]
    assert "extra" in ports and len(ports) > 1
    extra["on"] = False
    c.finish(1, rank=1)  # the next incarnation applies the objects again
    c.settle(10)
    running(c)
    assert c.status["restarts"] == 1
    assert set(c.objects[("ConfigMap", "job-config")]["data"]) == {"config.json"}, (
        "what it stopped rendering is gone")
    assert json.loads(c.objects[("ConfigMap", "job-config")]["data"]["config.json"])["nodes"] == 2
    service = c.objects[("Service", "job")]
    assert EXTRA_LABEL not in service["metadata"]["labels"] and service["spec"]["clusterIP"] == "None"
    assert [p["name"] for p in service["spec"]["ports"]] == [p for p in ports if p != "extra"]
    assert service["metadata"]["annotations"] == {"someone": "else"}, "what another writer set stays"


def test_a_foreign_object_of_the_same_name_is_left_alone_with_an_event():
    c = FakeCluster(job_body("taken", nodes=2))
    foreign = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "taken-config"},
               "data": {"mine": "1"}}
    c.kube.put(path("v1", "configmaps", "ns", "taken-config"), foreign)
    c.reconcile()
    conflict = next(e for e in c.events if e.reason == "ObjectConflict")
    assert conflict.type == "Warning"
    assert conflict.message == ("ConfigMap taken-config exists and is not owned by this job; "
                                "delete it or rename the job")
    assert c.objects[("ConfigMap", "taken-config")]["data"] == {"mine": "1"}
    assert not c.pods, "no pod starts without its own ConfigMap"
    assert c.phase == "Pending"
    c.kube.remove(path("v1", "configmaps", "ns", "taken-config"))  # the user resolves the conflict
    running(c)
    owner = c.objects[("ConfigMap", "taken-config")]["metadata"]["ownerReferences"][0]
    assert owner["name"] == "taken" and "config.json" in c.objects[("ConfigMap", "taken-config")]["data"]


def test_a_status_field_the_model_lacks_is_refused_not_dropped():
    kube = MemoryKube()
    kube.put(JOB, {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "metadata": {"name": "j"},
                   "status": {"phase": "Running"}})
    with pytest.raises(ApiError, match="tokensPerSecnd") as refused:
        asyncio.run(kube.patch(f"{JOB}/status", {"status": {"training": {"tokensPerSecnd": 7.5}}}))
    assert refused.value.status == 422
    assert asyncio.run(kube.get(JOB))["status"] == {"phase": "Running"}
    # What the operator reads of a status it cannot read is left out; the rest still counts.
    read = status.read({"phase": "Running", "restarts": "two", "newerField": 1, "training": {"step": 3}})
    assert status.wire(read) == {"phase": "Running", "training": {"step": 3}}
    assert status.patch({"phase": "Running", "newerField": 1}, status.read({"phase": "Failed"})) == {
        "phase": "Failed"}, "a field the model does not know is left as it is"
    # The pass's objects are written whole: a field one no longer has is removed from the stored object.
    stored = {"phase": "Running", "elastic": {"nodes": 2, "roomSince": "2030-01-01T00:00:00Z", "room": 4}}
    assert status.patch(stored, status.read({"phase": "Running", "elastic": {"nodes": 4, "room": 4}})) == {
        "elastic": {"nodes": 4, "roomSince": None, "room": 4}, "phase": "Running"}


def test_every_scraped_gauge_fills_a_field_of_the_status_model():
    for table in (contract.SCRAPED, contract.SCRAPED_CHECKPOINT, contract.SCRAPED_REQUEST):
        for metric, field_path in table.items():
            assert status.field(field_path).kind in (int, float, str), (metric, field_path)
    assert status.field("training.tokens_per_second").key == "tokensPerSecond"
    assert status.field("checkpoint.request_committed.step").key == "step"
    with pytest.raises(KeyError):
        status.field("training.tokens_per_secnd")
    assert contract.SCRAPED.keys() >= contract.SCRAPED_UNSET_AT_ZERO


def test_a_scrape_is_written_through_the_model_and_merged_field_by_field():
    read = scrape.Figures(
        {"step": 3, "tokensPerSecond": 5.0}, {"step": 2, "resumedFrom": 0},
        {"token": "t1", "step": 2, "time": "2030-01-01T00:00:00Z"},
        {"busBandwidthGBps": 10.0, "nodes": [{"node": "n0", "nodeRank": 0, "busBandwidthGBps": 10.0}]},
        {"medianOwnSeconds": 1.0, "ranks": [{"rank": 1, "node": "n1", "lag": 0.3, "ownSeconds": 1.3}]},
        {"step": 3, "startupSeconds": 4.0, "trainSeconds": 2.5})
    patch = scrape.status_patch(read, "/ckpt", 1, T0)
    # status.trainerTime is replaced whole: a field this incarnation has not set is removed
    unset = {"preflightSeconds": None, "checkpointStallSeconds": None, "resumedFrom": None, "round": None,
             "roundCause": None, "previousRound": None}
    assert patch == {
        "training": {"step": 3, "tokensPerSecond": 5.0, "updated": "2030-01-01T00:00:00Z"},
        "checkpoint": {"step": 2, "path": "/ckpt/step-00000002", "resumedFrom": 0, "resumedAtRestart": 1,
                       "requestCommitted": {"token": "t1", "step": 2, "time": "2030-01-01T00:00:00Z"}},
        "preflight": {"restart": 1, "busBandwidthGBps": 10.0, "updated": "2030-01-01T00:00:00Z",
                      "nodes": [{"node": "n0", "nodeRank": 0, "busBandwidthGBps": 10.0}]},
        "stragglers": {"restart": 1, "step": 3, "medianOwnSeconds": 1.0, "updated": "2030-01-01T00:00:00Z",
                       "ranks": [{"rank": 1, "node": "n1", "lag": 0.3, "ownSeconds": 1.3}]},
        "trainerTime": {"restart": 1, "step": 3, "startupSeconds": 4.0, "trainSeconds": 2.5, **unset,
                        "updated": "2030-01-01T00:00:00Z"}}
    assert scrape.status_patch(scrape.Figures({}, {}, {}, {}, {}, {}), "/ckpt", 1, T0) == {
        "training": {"updated": "2030-01-01T00:00:00Z"},
        "trainerTime": {"restart": 1, "updated": "2030-01-01T00:00:00Z", "step": None, "startupSeconds": None,
                        "trainSeconds": None, **unset}}
    kube = MemoryKube()
    kube.put(JOB, {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "metadata": {"name": "j"},
                   "status": {"phase": "Running", "training": {"loss": 6.5}}})
    written = asyncio.run(kube.patch(f"{JOB}/status", {"status": patch}))
    assert written["status"]["training"] == {"loss": 6.5, **patch["training"]}, "a figure not read stays"


def test_a_scrape_of_a_later_round_keeps_rank_0s_last_account_of_the_round_before():
    def account(**fields):
        return scrape.Figures({}, {}, {}, {}, {}, fields)

    first = account(step=9, round=0, trainSeconds=30.0, resumedFrom=0)
    round0 = TrainerTimeStatus.model_validate(scrape.status_patch(first, None, 1, T0)["trainerTime"])
    assert round0.previous_round is None
    later = account(step=5, round=1, trainSeconds=2.0, resumedFrom=4, roundCause="node 1 exited 1")
    round1 = TrainerTimeStatus.model_validate(scrape.status_patch(later, None, 1, T0, round0)["trainerTime"])
    assert round1.round == 1 and round1.round_cause == "node 1 exited 1"
    assert round1.previous_round == TrainerAccount(step=9, train_seconds=30.0, resumed_from=0)
    again = TrainerTimeStatus.model_validate(scrape.status_patch(later, None, 1, T0, round1)["trainerTime"])
    assert again.previous_round == round1.previous_round, "kept while the round lasts"
    other = scrape.status_patch(later, None, 2, T0, round0)["trainerTime"]
    assert other["previousRound"] is None, "another incarnation's account is no round before"
    exposition = ('tetrad_round{cause="node 1 exited 1 (a worker ended)"} 1.0\n'
                  "tetrad_step 5.0\ntetrad_resumed_from_step 4.0\n")
    (read,) = scrape.parse_each(exposition, contract.SCRAPED_TRAINER_TIME)
    assert read == {"round": 1, "step": 5, "resumedFrom": 4}
    cause = scrape.trainer_time(scrape.samples_of(exposition))["roundCause"]
    assert cause == "node 1 exited 1 (a worker ended)"


def test_the_informer_lists_watches_and_lists_again_when_its_version_is_gone():
    nodes = path("v1", "nodes")
    kube = MemoryKube()
    kube.put(f"{nodes}/a", node_body("a"))
    seen: list[tuple[str | None, str | None]] = []

    def changed(old: NodeState | None, new: NodeState | None) -> None:
        if old != new:  # a relist tells every object again; the controller, too, looks at changes only
            seen.append((old.name if old else None, new.name if new else None))

    informer = Informer(kube, nodes, NodeState.from_body, changed)

    async def go() -> None:
        task = asyncio.create_task(informer.run())
        await informer.synced.wait()
        kube.put(f"{nodes}/b", node_body("b"))
        await kube.idle()
        kube.compact()  # the watch ends with 410 Gone: the informer lists again ...
        kube.remove(f"{nodes}/a")  # ... and finds what went meanwhile
        await asyncio.sleep(0)
        await kube.idle()
        task.cancel()

    asyncio.run(go())
    assert seen == [(None, "a"), (None, "b"), ("a", None)]
    assert set(informer.items) == {"b"}
