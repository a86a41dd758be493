"""Small pieces: observed-state parsing, the metrics reader, settings, REST paths, and the job loop's
own memory and writes, on the in-memory Kubernetes."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import math
import socket
import time

import kopf
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, start_http_server
from tetrad_operator import controller, scrape, status
from tetrad_operator.admission import created_released, ungate_patch
from tetrad_operator.controller import (
    FINALIZER,
    FINALIZER_WAIT_SECONDS,
    QUEUE_READ_SECONDS,
    Controller,
    JobLoop,
    job_key,
    pod_view,
)
from tetrad_operator.kubeapi import ApiError, path
from tetrad_operator.lifecycle import Settings as LifecycleSettings
from tetrad_operator.observed import NodeState, PodState
from tetrad_operator.settings import OperatorSettings

from tetrad.api import contract
from tetrad.api.spec import ParallelTrainingJobStatus

from .conftest import free_port
from .fakes import T0, ScenarioClock, decline, job_body
from .memory_kube import MemoryKube

JOB = path(contract.API_VERSION, contract.PLURAL, "ns", "j")


def pod_body(**status) -> dict:
    return {"metadata": {"name": "j-r2-1", "uid": "u", "namespace": "ns",
                         "labels": {contract.LABEL_JOB: "j", contract.LABEL_RESTART: "2",
                                    contract.LABEL_RANK: "1",
                                    contract.LABEL_MANAGED_BY: contract.MANAGED_BY}},
            "spec": {"containers": [{"name": "trainer"}],
                     "schedulingGates": [{"name": contract.GANG_GATE}, {"name": "other"}]},
            "status": status}


def test_pod_state_reads_labels_gates_and_exit_codes():
    p = PodState.from_body(pod_body(phase="Failed", containerStatuses=[
        {"name": "sidecar", "state": {"terminated": {"exitCode": 9}}},
        {"name": "trainer", "state": {"terminated": {"exitCode": 75}}}]))
    assert (p.job, p.restart, p.rank, p.namespace) == ("j", 2, 1, "ns")
    assert p.gated and not p.released
    assert (p.exit_code, p.container) == (75, "trainer")  # the trainer's code wins
    init = PodState.from_body(pod_body(phase="Failed", initContainerStatuses=[
        {"name": "setup", "state": {"terminated": {"exitCode": 1}}}]))
    assert (init.exit_code, init.container) == (1, "setup")
    evicted = PodState.from_body(pod_body(phase="Failed", reason="Evicted", conditions=[
        {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}]))
    assert evicted.exit_code is None and evicted.disrupted == "TerminationByKubelet"
    stopped = PodState.from_body(pod_body(phase="Running", conditions=[  # Kueue stopping its pod group
        {"type": "TerminationTarget", "status": "True", "reason": "WorkloadEvictedDueToPreempted",
         "message": "Preempted to accommodate a workload"}]))
    assert stopped.disrupted == "WorkloadEvictedDueToPreempted: Preempted to accommodate a workload"
    unplaced = PodState.from_body(pod_body(phase="Pending", conditions=[
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/4 nodes are available"}]))
    assert unplaced.unschedulable == "0/4 nodes are available"


def test_the_pod_watch_keeps_the_operators_pods_in_any_phase_and_others_while_they_take_room():
    ours, ended = pod_body(phase="Running"), pod_body(phase="Succeeded")
    assert pod_view(ours).job == "j" and pod_view(ended).phase == "Succeeded"
    assert job_key(pod_view(ended)) == ("ns", "j")
    foreign = pod_body(phase="Running")
    del foreign["metadata"]["labels"][contract.LABEL_MANAGED_BY]  # a job label alone is not Tetrad's
    assert pod_view(foreign).job == "" and job_key(pod_view(foreign)) is None
    assert pod_view({**foreign, "status": {"phase": "Failed"}}) is None


def test_node_state():
    n = NodeState.from_body({"metadata": {"name": "n", "labels": {"a": "b"}},
                             "spec": {"unschedulable": True,
                                      "taints": [{"key": "k", "effect": "NoSchedule"}]},
                             "status": {"allocatable": {"cpu": "500m", "nvidia.com/gpu": "8"},
                                        "conditions": [{"type": "Ready", "status": "False",
                                                        "lastTransitionTime": "2030-01-01T00:00:00Z"}]}})
    assert not n.ready and n.unschedulable and n.ready_changed == T0
    assert n.allocatable.get("cpu") == 500 and n.allocatable.get("nvidia.com/gpu") == 8
    assert n.label_map == {"a": "b"}


def test_scrape_parses_a_real_exposition():
    r = CollectorRegistry()
    Gauge("tetrad_step", "", registry=r).set(12)
    Gauge("tetrad_loss", "", registry=r).set(float("nan"))  # not JSON: left out
    g = Gauge("tetrad_tokens_per_second", "", ["rank"], registry=r)
    g.labels("1").set(5.0)
    g.labels("0").set(7.5)
    Counter("tetrad_mfu", "", registry=r).inc(0.5)  # a counter is read too (sample tetrad_mfu_total)
    Gauge("other_metric", "", registry=r).set(1)
    out = scrape.parse(generate_latest(r).decode())
    assert out == {"step": 12, "tokensPerSecond": 7.5, "mfu": 0.5}
    assert isinstance(out["step"], int) and not any(isinstance(v, float) and math.isnan(v)
                                                    for v in out.values())


def test_scrape_reads_the_heartbeat_as_a_time_and_leaves_out_one_never_set():
    r = CollectorRegistry()
    beat = Gauge(contract.METRIC_LAST_STEP_TIME, "", registry=r)
    Gauge(contract.METRIC_STARTUP, "", registry=r)
    Gauge(contract.METRIC_TOKENS_PER_SECOND, "", registry=r)  # no step yet: no throughput, not 0 tokens/s
    Gauge(contract.METRIC_MFU, "", registry=r)
    Gauge(contract.METRIC_STEP_TIME, "", registry=r).set(1.25)
    assert scrape.parse(generate_latest(r).decode()) == {"stepTimeSeconds": 1.25}  # a gauge never set reads 0
    beat.set(T0.timestamp() + 61.7)
    assert scrape.parse(generate_latest(r).decode()) == {"stepTimeSeconds": 1.25,
                                                         "lastStepTime": "2030-01-01T00:01:01Z"}


def test_scrape_reads_the_checkpoint_and_leaves_out_what_is_not_set_yet():
    r = CollectorRegistry()
    gauges = {name: Gauge(name, "", ["rank"], registry=r) for name in contract.SCRAPED_CHECKPOINT}
    for g in gauges.values():  # as the trainer starts them: NaN until set
        g.labels("0").set(math.nan)
    Gauge(contract.METRIC_STEP, "", registry=r).set(57)
    text = generate_latest(r).decode()
    assert scrape.parse(text, contract.SCRAPED_CHECKPOINT) == {} and scrape.checkpoint({}, "/ckpt", 2) == {}
    gauges[contract.METRIC_RESUMED_FROM].labels("0").set(40)
    gauges[contract.METRIC_RESUMED_FROM].labels("1").set(39)  # rank 0's wins
    out = scrape.checkpoint(scrape.parse(generate_latest(r).decode(), contract.SCRAPED_CHECKPOINT),
                            "/ckpt", 2)
    # no commit in this incarnation yet: no step, no path
    assert out == {"resumedFrom": 40, "resumedAtRestart": 2}
    gauges[contract.METRIC_CHECKPOINT_STEP].labels("0").set(50)
    gauges[contract.METRIC_CHECKPOINT_TIME].labels("0").set(T0.timestamp() + 3.2)
    text = generate_latest(r).decode()
    out = scrape.checkpoint(scrape.parse(text, contract.SCRAPED_CHECKPOINT), "/mnt/ckpt", 2)
    assert out == {"step": 50, "time": "2030-01-01T00:00:03Z",
                   "path": "/mnt/ckpt/" + contract.step_dir_name(50),
                   "resumedFrom": 40, "resumedAtRestart": 2}
    assert isinstance(out["step"], int) and out["path"] == "/mnt/ckpt/step-00000050"
    # status.training's step is the training step, not the checkpoint's
    assert scrape.parse(text) == {"step": 57}


def stored(kube: MemoryKube, job_status: dict, revision: int = 7) -> dict:
    """The job ns/j as the API server holds it at `revision`, as the loop read it."""
    kube.revision = revision - 1
    return copy.deepcopy(kube.put(JOB, {"apiVersion": contract.API_VERSION, "kind": contract.KIND,
                                        "metadata": {"name": "j"}, "status": job_status}))


def patches(kube: MemoryKube) -> list:
    return [r.body for r in kube.requests if r.verb == "PATCH"]


def test_the_status_write_leaves_the_scrapers_fields_alone():
    kube = MemoryKube()
    ctl = Controller(kube, OperatorSettings())
    checkpoint = {"step": 50, "path": "/ckpt/step-00000050"}
    old = {"phase": "Running", "restarts": 0, "message": "m", "training": {"step": 57},
           "checkpoint": checkpoint}
    body = stored(kube, old)
    new = status.read({"phase": "Restarting", "restarts": 1})
    assert asyncio.run(ctl._write_status(JobLoop(("ns", "j")), JOB, body, new))
    assert patches(kube) == [{"metadata": {"resourceVersion": "7"},
                              "status": {"phase": "Restarting", "restarts": 1, "message": None}}]


def test_scrape_fetch_reads_an_endpoint_and_never_raises():
    r = CollectorRegistry()
    Gauge("tetrad_peak_memory_bytes", "", registry=r).set(2**40)
    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=r)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections, never answers

    async def go():
        import aiohttp

        async with aiohttp.ClientSession() as s:
            ok = await scrape.fetch(s, "127.0.0.1", port, 2.0)
            closed = await scrape.fetch(s, "127.0.0.1", free_port(), 0.5)
            hung = await scrape.fetch(s, "127.0.0.1", silent.getsockname()[1], 0.2)
            return ok, closed, hung

    try:
        ok, closed, hung = asyncio.run(go())
    finally:
        server.shutdown()
        server.server_close()
        silent.close()
    assert ok == ({"peakMemoryBytes": 2**40}, {}, {}, {}, {}, {}) and closed is None and hung is None


def test_a_scrape_wakes_the_job_loop_when_the_heartbeat_stood_still_or_a_round_began():
    """A real endpoint scraped into a stored job: a read whose heartbeat did not move since the last one
    (a stall may be due) or that shows a new round in place wakes the loop at once; a step does not (the
    loop's timed pass judges it: a wake per scrape of every healthy job would double the passes)."""
    r = CollectorRegistry()
    beat = Gauge(contract.METRIC_LAST_STEP_TIME, "", registry=r)
    round_of = Gauge(contract.METRIC_ROUND, "", [contract.LABEL_ROUND_CAUSE], registry=r)
    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=r)
    kube = MemoryKube()
    ctl = Controller(kube, OperatorSettings())
    loop = ctl.jobs[("ns", "j")] = JobLoop(("ns", "j"))
    loop.keep(stored(kube, {"phase": "Running", "restarts": 0}), read=True)

    async def scrape_once() -> bool:
        loop.wake.clear()
        await ctl._scrape(("ns", "j"), "127.0.0.1", port, "/ckpt", 0)
        return loop.wake.is_set()

    async def go() -> list[bool]:
        import aiohttp

        ctl.session = aiohttp.ClientSession()
        woken = []
        try:
            for at in (1_000_000_000, 1_000_000_000, 1_000_000_005):
                beat.set(at)
                woken.append(await scrape_once())
            round_of.labels("rank 1 exited 1").set(1)
            beat.set(1_000_000_009)
            woken.append(await scrape_once())
        finally:
            await ctl.session.close()
        return woken

    try:
        woken = asyncio.run(go())
    finally:
        server.shutdown()
        server.server_close()
    # the first beat, the same beat, a step, a new round with a step
    assert woken == [False, True, False, True]
    assert loop.body["status"]["training"]["lastStepTime"] == "2001-09-09T01:46:49Z"


def test_a_read_wanted_now_while_one_is_in_flight_is_owed_by_that_one_whose_end_wakes_the_loop():
    """A stall's deadline passed since the last read, so the pass wants a read now, while a read started
    before it is still in flight: no second read starts, and the one in flight wakes the loop when it
    ends, whatever it read (here: nothing, rank 0 does not answer), so the judgment waits for no timed
    pass (up to a resync, 30 s by default). A read nobody waits for ends without waking the loop."""
    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections, never answers
    kube = MemoryKube()
    ctl = Controller(kube, OperatorSettings(scrape_host="127.0.0.1", scrape_timeout_seconds=0.3))
    loop = ctl.jobs[("ns", "j")] = JobLoop(("ns", "j"))
    body = stored(kube, {"phase": "Running", "restarts": 0})
    body["spec"] = {"metrics": {"port": silent.getsockname()[1]}}
    loop.keep(body, read=True)
    decided = ParallelTrainingJobStatus(phase="Running", restarts=0)

    async def read(wanted_now: bool) -> tuple[bool, bool, bool]:
        """(no second read started, the wish was owed, the loop woken at the first read's end)"""
        loop.scraping.next_at, loop.wake = 0.0, asyncio.Event()
        ctl._maybe_scrape(body, loop, [], decided)
        first = loop.scraping.task
        ctl._maybe_scrape(body, loop, [], decided, due=wanted_now)
        alone, owed = loop.scraping.task is first, loop.scraping.owed
        assert first is not None and not loop.wake.is_set()
        await first
        return alone, owed, loop.wake.is_set() and not loop.scraping.owed

    async def go() -> list[tuple[bool, bool, bool]]:
        import aiohttp

        ctl.session = aiohttp.ClientSession()
        try:
            return [await read(True), await read(False)]
        finally:
            await ctl.session.close()

    try:
        answers = asyncio.run(go())
    finally:
        silent.close()
    assert answers == [(True, True, True), (True, False, False)]


def test_scrape_reads_the_checkpoint_now_request_rank_0_committed():
    r = CollectorRegistry()
    step = Gauge(contract.METRIC_REQUEST_STEP, "", [contract.LABEL_REQUEST_TOKEN], registry=r)
    at = Gauge(contract.METRIC_REQUEST_TIME, "", [contract.LABEL_REQUEST_TOKEN], registry=r)
    samples = scrape.samples_of(generate_latest(r).decode())
    assert scrape.request_committed(samples) == {}  # no request served yet: no sample
    step.labels("2030-01-01T00:00:00Z").set(140)
    at.labels("2030-01-01T00:00:00Z").set(1_900_000_000)
    samples = scrape.samples_of(generate_latest(r).decode())
    assert scrape.request_committed(samples) == {"token": "2030-01-01T00:00:00Z", "step": 140,
                                                 "time": "2030-03-17T17:46:40Z"}


def test_the_status_write_merges_what_the_pass_learned_into_the_scrapers_objects():
    kube = MemoryKube()
    ctl = Controller(kube, OperatorSettings())
    old = {"phase": "Suspended", "checkpoint": {"step": 50, "resumedFrom": 0}, "training": {"step": 49}}
    body = stored(kube, old)
    new = status.read({"phase": "Suspended"})
    learned = {"checkpoint": {"step": 50, "resumedFrom": None}, "training": {"step": 50}}
    assert asyncio.run(ctl._write_status(JobLoop(("ns", "j")), JOB, body, new, learned))
    nothing_new = {"checkpoint": {"step": 50}, "training": {"step": 49}}
    assert asyncio.run(ctl._write_status(JobLoop(("ns", "j")), JOB, body, new, nothing_new))  # no write
    assert patches(kube) == [{"metadata": {"resourceVersion": "7"}, "status": {
        "phase": "Suspended", "checkpoint": {"resumedFrom": None}, "training": {"step": 50}}}]


def version(rv: str) -> dict:
    return {"metadata": {"resourceVersion": rv}}


def test_a_job_loop_holds_the_newest_body_it_has_seen():
    loop = JobLoop(("ns", "j"))
    loop.keep(version("5"))
    assert loop.body is None, "the watch alone never fills an empty loop: the first pass GETs"
    loop.keep(version("5"), read=True)
    loop.keep(version("7"))
    loop.keep(version("6"))  # an event lagging behind our own write's answer
    assert loop.body == version("7")
    loop.keep(version("6"), read=True)  # the scraper's earlier write, answered late
    assert loop.body == version("7")
    loop.keep(version("x"))  # not a number: no order is known
    assert loop.body is None


def test_a_status_write_keeps_its_answer_and_a_lost_one_drops_the_body():
    kube = MemoryKube()
    body, new = stored(kube, {"phase": "Pending"}), status.read({"phase": "Running"})
    loop = JobLoop(("ns", "j"))
    loop.keep(body, read=True)
    ctl = Controller(kube, OperatorSettings())
    assert asyncio.run(ctl._write_status(loop, JOB, body, new))
    assert loop.body == asyncio.run(kube.get(JOB)) and loop.body["metadata"]["resourceVersion"] == "8"
    # A pass that read the job before that write (resourceVersion 7) loses: 409.
    assert not asyncio.run(ctl._write_status(loop, JOB, body, status.read({"phase": "Failed"})))
    assert loop.body is None


def test_a_job_kueue_holds_reads_its_workload_at_most_every_few_seconds():
    kube = MemoryKube()
    workload = path("kueue.x-k8s.io/v1beta2", "workloads", "ns", "j")

    def kueue_says(message: str) -> None:
        kube.put(workload, {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
                            "metadata": {"name": "j"},
                            "status": {"conditions": [{"type": "QuotaReserved", "status": "False",
                                                       "message": message}]}})

    ctl = Controller(kube, OperatorSettings())
    loop = JobLoop(("ns", "j"))
    spec = loop.resolved(job_body("j", gang={"scheduler": "kueue", "queue": "team-a"}))
    waiting = [PodState(name=f"j-r0-{i}", uid=str(i), job="j", restart=0, rank=i, phase="Pending")
               for i in range(2)]
    # a burst of passes (pod events come many a second): one read, the same reason
    kueue_says("no quota (1)")
    assert [asyncio.run(ctl._queued(loop, spec, waiting)) for _ in range(5)] == ["no quota (1)"] * 5
    def gets() -> list[str]:
        return [r.path for r in kube.requests if r.verb == "GET"]

    assert gets() == [workload]
    kueue_says("no quota (2)")
    key, at, reason = loop.queue_read
    loop.queue_read = (key, at - QUEUE_READ_SECONDS, reason)  # that read is now old enough
    assert asyncio.run(ctl._queued(loop, spec, waiting)) == "no quota (2)"
    # the next incarnation's pods (Kueue's group keeps its name) read it at once
    kueue_says("no quota (3)")
    next_incarnation = [dataclasses.replace(p, name=f"j-r1-{p.rank}", restart=1) for p in waiting]
    assert asyncio.run(ctl._queued(loop, spec, next_incarnation)) == "no quota (3)"
    running = [dataclasses.replace(p, phase="Running", node="n0") for p in next_incarnation]
    # nothing waits: no read
    assert asyncio.run(ctl._queued(loop, spec, running)) is None and len(gets()) == 3


def test_only_a_change_the_decisions_see_wakes_a_job_loop():
    ctl = Controller(MemoryKube(), OperatorSettings())
    loop = ctl.jobs[("ns", "j")] = JobLoop(("ns", "j"))
    pod = PodState.from_body(pod_body(phase="Pending"))
    assert (pod.namespace, pod.job) == loop.key
    ctl.on_pod_change(pod, dataclasses.replace(pod))  # an update of fields no view holds
    assert not loop.wake.is_set()
    ctl.on_pod_change(pod, dataclasses.replace(pod, phase="Running"))
    assert loop.wake.is_set()
    loop.wake.clear()
    ctl.on_pod_change(pod, None)  # deleted
    assert loop.wake.is_set()
    node = NodeState(name="n0", ready=True)
    loop.wake.clear()
    ctl.on_node_change(node, dataclasses.replace(node))  # a heartbeat
    assert not loop.wake.is_set()


def test_settings_from_env():
    s = OperatorSettings.from_env({"TETRAD_OPERATOR_RESYNC_SECONDS": "4",
                                   "TETRAD_OPERATOR_NODE_LOST_SECONDS": "7",
                                   "TETRAD_OPERATOR_SCRAPE_HOST": "127.0.0.1", "UNRELATED": "x"})
    assert s.resync_seconds == 4.0 and s.scrape_host == "127.0.0.1"
    assert s.lifecycle.node_lost_seconds == 7.0
    assert s.lifecycle.stuck_terminating_seconds == LifecycleSettings().stuck_terminating_seconds == 30.0
    assert OperatorSettings.from_env(
        {"TETRAD_OPERATOR_POD_CREATE_ATTEMPTS": "5"}).lifecycle.pod_create_attempts == 5
    with pytest.raises(ValueError, match="TETRAD_OPERATOR_NODE_LOST_SECONDS='soon' is not a valid float"):
        OperatorSettings.from_env({"TETRAD_OPERATOR_NODE_LOST_SECONDS": "soon"})
    with pytest.raises(ValueError, match="TETRAD_OPERATOR_API_CONCURRENCY"):
        OperatorSettings.from_env({"TETRAD_OPERATOR_API_CONCURRENCY": "lots"})


def test_rest_paths_and_patches():
    assert path("v1", "Pod", "ns", "p") == "/api/v1/namespaces/ns/pods/p"
    assert path("tetrad.dev/v1alpha1", "paralleltrainingjobs", "ns", "j", "status") == \
        "/apis/tetrad.dev/v1alpha1/namespaces/ns/paralleltrainingjobs/j/status"
    assert path("v1", "nodes") == "/api/v1/nodes"
    patch = ungate_patch(T0)
    assert patch["spec"] == {"schedulingGates": [{"name": contract.GANG_GATE, "$patch": "delete"}]}
    # a pin narrows the gated pod's nodeSelector (strategic merge keeps its other entries)
    assert ungate_patch(T0, {"rack": "r1"})["spec"] == {
        "schedulingGates": [{"name": contract.GANG_GATE, "$patch": "delete"}], "nodeSelector": {"rack": "r1"}}
    gated = {"metadata": {"name": "p"}, "spec": {"nodeSelector": {"pool": "x"}, "containers": [],
                                                 "schedulingGates": [{"name": contract.GANG_GATE}]}}
    created = created_released(gated, T0, {"rack": "r1"})
    assert created["spec"] == {"nodeSelector": {"pool": "x", "rack": "r1"}, "containers": []}
    assert created_released(gated, T0)["spec"]["nodeSelector"] == {"pool": "x"}


def test_a_job_loop_lists_its_pods_once_per_resync_period_and_not_for_a_job_never_reconciled():
    loop = JobLoop(("ns", "j"))
    reconciled = {"status": {"phase": "Pending"}}
    assert loop.list_due(reconciled, 30.0), "a loop's first pass lists the pods of a job that has a status"
    loop.pods.last_listed = time.monotonic()
    assert not loop.list_due(reconciled, 30.0)
    loop.pods.last_listed -= 31.0
    assert loop.list_due(reconciled, 30.0), "once per resync period"
    new = JobLoop(("ns", "k"))
    assert not new.list_due({"metadata": {}}, 30.0), (
        "no status: nothing of ours exists that the watch could hide")
    assert not new.list_due({"metadata": {}}, 30.0), "asking changes nothing"
    new.pods.last_listed = time.monotonic()  # what reconcile does on a new job's first pass
    assert not new.list_due({"status": {"phase": "Pending"}}, 30.0), "its first pass started the period"
    new.pods.last_listed -= 31.0
    assert new.list_due({"status": {"phase": "Pending"}}, 30.0)


def test_a_new_jobs_first_pass_waits_for_kopfs_finalizer_before_writing_anything():
    kube = MemoryKube()
    ctl = Controller(kube, OperatorSettings())
    loop = JobLoop(("ns", "j"))
    new = {"metadata": {"name": "j", "namespace": "ns", "resourceVersion": "5"}}
    loop.keep(new, read=True)
    loop.body_read = time.monotonic()
    assert 0 < asyncio.run(ctl.reconcile(loop)) <= FINALIZER_WAIT_SECONDS and not kube.requests, \
        "no write races kopf's finalizer patch"
    # the watch
    loop.keep({"metadata": {**new["metadata"], "resourceVersion": "6", "finalizers": [FINALIZER]}})
    assert not loop.awaits_finalizer(loop.body)
    assert not loop.awaits_finalizer({**new, "status": {"phase": "Pending"}}), (
        "a job reconciled before never waits")
    loop.started -= FINALIZER_WAIT_SECONDS
    assert not loop.awaits_finalizer(new), "nor for longer than FINALIZER_WAIT_SECONDS"


class Stopped:
    """kopf's DaemonStopped as the job loop uses it: true once set, and awaitable."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __bool__(self) -> bool:
        return self.event.is_set()

    async def wait(self) -> None:
        await self.event.wait()


def test_a_new_jobs_loop_goes_on_the_moment_kopfs_finalizer_shows(monkeypatch):
    """The new-job path has no fixed wait: the loop's first pass finds no finalizer and writes
    nothing; the watch event that brings kopf's finalizer starts the next pass at once. The clock
    stands still, and the bound on the wait and the loop's batching are far longer than the test
    may take, so only the event can have started the pass that writes the status."""
    monkeypatch.setattr(controller, "FINALIZER_WAIT_SECONDS", 600.0)
    clock = ScenarioClock(T0)
    kube = MemoryKube(clock=clock.now)
    job = path(contract.API_VERSION, contract.PLURAL, "ns", "job")
    new = kube.put(job, job_body())
    ctl = Controller(kube, OperatorSettings(batch_seconds=600.0), clock=clock)
    ctl.admission.reserve = decline  # type: ignore[method-assign]  # no admission round runs here
    passes: list[float] = []
    written = asyncio.Event()
    ctl.on_decision = lambda loop, decision: written.set()

    async def scenario() -> None:
        stopped = Stopped()
        run = asyncio.create_task(ctl.run_job("ns", "job", stopped, copy.deepcopy(new)))
        real_reconcile = ctl.reconcile

        async def reconcile(loop: JobLoop) -> float | None:
            passes.append(clock.monotonic())
            return await real_reconcile(loop)

        ctl.reconcile = reconcile  # type: ignore[method-assign]
        while not passes:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert not kube.requests and ctl.jobs[("ns", "job")].awaiting_kopf, "the first pass writes nothing"
        held = await kube.patch(job, {"metadata": {"finalizers": [FINALIZER]}})  # kopf's patch
        ctl.job_seen(("ns", "job"), held)  # and its watch event (handlers.job_changed)
        await asyncio.wait_for(written.wait(), timeout=60)
        stopped.event.set()
        await run

    asyncio.run(scenario())
    assert passes == [0.0, 0.0], "two passes, and no time passed between them"
    assert (asyncio.run(kube.get(job)) or {})["status"]["phase"] == "Pending"


def test_a_new_jobs_first_pass_reads_the_body_kopf_brought_and_a_reconciled_one_gets_it():
    new = {"metadata": {"name": "j", "namespace": "ns", "resourceVersion": "5"}}
    loop = JobLoop(("ns", "j"))
    loop.first_seen(new)
    assert loop.body is new, "never reconciled: its first pass writes the status, guarded, before acting"
    kube = MemoryKube()
    ctl = Controller(kube, OperatorSettings())
    assert 0 < asyncio.run(ctl.reconcile(loop)) <= FINALIZER_WAIT_SECONDS and not kube.requests, \
        "no GET: the pass waits for kopf's finalizer from this body"
    reconciled = JobLoop(("ns", "k"))
    reconciled.first_seen({**new, "status": {"phase": "Running"}})
    assert reconciled.body is None, "a job with a status may act without writing: its first pass GETs"


def test_a_job_loop_resolves_the_spec_once_per_generation():
    body = job_body(nodes=2)
    loop = JobLoop(("ns", "job"))
    first = loop.resolved(body)
    assert first.config is not None and first.config.world_size == 2
    assert loop.resolved(copy.deepcopy(body)) is first, "the same generation is not parsed again"
    body["spec"]["runPolicy"] = {"maxRestarts": 7}
    assert loop.resolved(body) is first  # kept until the API server bumps the generation
    body["metadata"]["generation"] = 2
    second = loop.resolved(body)
    assert second is not first and second.job is not None and second.job.spec.run_policy.max_restarts == 7
    body["metadata"]["uid"] = "another"  # a job re-created under the same name
    assert loop.resolved(body) is not second


def test_a_job_loop_counts_refused_passes_and_lets_transient_errors_retry():
    quota = ApiError(403, "POST", "/api/v1/namespaces/ns/pods",
                     {"reason": "Forbidden", "message": "exceeded quota: q"})
    invalid = ApiError(422, "POST", "/api/v1/namespaces/ns/pods",
                       {"reason": "Invalid", "message": "spec.x: Invalid"})
    busy = ApiError(503, "POST", "/api/v1/namespaces/ns/pods", {"message": "the server is busy"})
    loop = JobLoop(("ns", "job"))
    assert loop.count_creations([quota, quota]) == [quota, quota]
    assert loop.rejection is not None and (loop.rejection.attempts, loop.rejection.message) == (
        1, "exceeded quota: q")
    assert loop.count_creations([busy, ConnectionError()]) == []
    assert loop.rejection.attempts == 1, "transient errors neither count nor reset"
    loop.count_creations([invalid])
    assert (loop.rejection.attempts, loop.rejection.message) == (2, "spec.x: Invalid")
    loop.count_creations([None, busy])  # a pod was created: the API server takes the job's pods again
    assert loop.rejection is None
    loop.count_creations([None, quota])  # some fit, the rest are refused: the count starts over
    assert loop.rejection is not None and loop.rejection.attempts == 1


def test_a_start_up_stopped_for_good_is_found_behind_kopfs_wrapper():
    from tetrad_operator.main import permanent_cause

    permanent = kopf.PermanentError("the gang admission must list and watch pods in ns")
    wrapper = RuntimeError("One or more handlers failed.")  # kopf's ActivityError is not public
    wrapper.__cause__ = permanent
    assert permanent_cause(wrapper) is permanent
    assert permanent_cause(RuntimeError("a bug")) is None, "anything else still raises"
