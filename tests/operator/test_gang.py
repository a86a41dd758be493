"""Built-in gang admission: the capacity fit and the admission order, without a cluster."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta

import pytest
from tetrad_operator import packing
from tetrad_operator.admission import GangAdmitter
from tetrad_operator.observed import NodeState, PodState
from tetrad_operator.operator_metrics import OperatorMetrics
from tetrad_operator.resources import Resources, pod_requests, to_units

from .fakes import T0, node_body
from .memory_kube import MemoryKube


def pod(name: str, cpu: str = "4", memory: str = "8Gi", gpu: int = 0, node: str | None = None,
        phase: str = "Pending", selector: dict[str, str] | None = None, tolerations: list | None = None,
        affinity: dict | None = None) -> PodState:
    limits = {"cpu": cpu, "memory": memory} | ({"nvidia.com/gpu": gpu} if gpu else {})
    spec = {"containers": [{"name": "trainer",
                            "resources": {"requests": dict(limits), "limits": dict(limits)}}],
            "nodeSelector": selector or {}, "tolerations": tolerations or []}
    if affinity:
        spec["affinity"] = affinity
    if node:
        spec["nodeName"] = node
    return PodState.from_body({"metadata": {"name": name, "uid": name, "labels": {}}, "spec": spec,
                               "status": {"phase": phase}})


def nodes(*bodies: dict) -> list[NodeState]:
    return [NodeState.from_body(b) for b in bodies]


def request(name: str, pods: list[PodState], age: int = 0) -> packing.GangRequest:
    return packing.GangRequest("ns", name, T0 + timedelta(seconds=age), 0, tuple(pods))


def test_quantities_and_effective_requests():
    assert to_units("cpu", "250m") == 250 and to_units("cpu", "2") == 2000 and to_units("cpu", 0.5) == 500
    assert to_units("memory", "1Gi") == 2**30 and to_units("memory", "1G") == 10**9
    spec = {"containers": [{"resources": {"requests": {"cpu": "1"}}},
                           {"resources": {"limits": {"cpu": "500m"}}}],
            "initContainers": [{"resources": {"requests": {"cpu": "3", "memory": "1Gi"}}}],
            "overhead": {"cpu": "100m"}}
    r = pod_requests(spec)
    assert r.get("cpu") == 3100 and r.get("memory") == 2**30 and r.get("pods") == 1
    assert (Resources.of({"cpu": 5}) - Resources.of({"cpu": 5})) == Resources()


def test_place_is_first_fit_decreasing_and_respects_capacity():
    ns = nodes(node_body("a", cpu="8"), node_body("b", cpu="12"))
    free = packing.free_capacity(ns, [])
    placement = packing.place([pod("small", cpu="2"), pod("big", cpu="10"), pod("mid", cpu="6")], ns, free)
    # Biggest first: big -> b (a is too small), mid -> a, small -> a.
    assert placement == {"big": "b", "mid": "a", "small": "a"}
    assert free["a"].get("cpu") == 0 and free["b"].get("cpu") == 2000
    assert packing.place([pod("x", cpu="3")], ns, free) is None
    assert free["b"].get("cpu") == 2000  # a failed placement changes nothing


def test_gpus_pods_slots_and_bound_pods_count():
    ns = nodes(node_body("a", cpu="96", gpu=8))
    bound = [pod("other", cpu="1", gpu=6, node="a", phase="Running"),
             pod("done", gpu=8, node="a", phase="Succeeded")]
    free = packing.free_capacity(ns, bound)
    assert free["a"].get("nvidia.com/gpu") == 2
    assert packing.place([pod("g", gpu=4)], ns, dict(free)) is None
    assert packing.place([pod("g", gpu=2)], ns, dict(free)) == {"g": "a"}
    few_slots = node_body("s", cpu="96")
    few_slots["status"]["allocatable"]["pods"] = "2"
    ns = nodes(few_slots)
    assert packing.place([pod(str(i), cpu="1") for i in range(3)], ns, packing.free_capacity(ns, [])) is None


def staged_pods() -> list[PodState]:
    """The pods of a pp=2 job over 4 nodes whose stages go one rack each (gang.topologyKey)."""
    from tetrad.api import parse
    from tetrad.render import render

    doc = {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob",
           "metadata": {"name": "j", "namespace": "ns"},
           "spec": {"nodes": 4, "parallelism": {"pp": 2, "dpShard": 2}, "training": {"globalBatch": 8},
                    "resources": {"cpu": "6"}, "gang": {"topologyKey": "rack"}}}
    job, problems = parse(doc)
    assert job is not None, problems
    return [dataclasses.replace(PodState.from_body(p), uid=p["metadata"]["name"]) for p in render(job).pods]


def mixed_racks() -> list[NodeState]:
    """Racks r0 (one node, first by name), r1 and r2 (two each), and an unlabelled node."""
    racks = {"a": "r0", "b": "r1", "c": "r1", "d": "r2", "e": "r2"}
    return nodes(*(node_body(n, cpu="8", labels={"rack": r}) for n, r in racks.items()),
                 node_body("f", cpu="8"))


def test_a_release_pins_each_stage_to_the_rack_its_fit_chose():
    """The scheduler places a stage's first pod alone: unpinned it could take rack r0, where the
    stage's second pod never fits. The release adds each stage's rack to its pods' nodeSelector."""
    ns = mixed_racks()
    (release,) = packing.plan_admission(ns, [], [], [request("j", staged_pods())])
    assert release.pins == {"j-r0-0": {"rack": "r1"}, "j-r0-1": {"rack": "r1"},
                            "j-r0-2": {"rack": "r2"}, "j-r0-3": {"rack": "r2"}}
    pinned = {p.name: p for p in release.pinned()}
    assert [n.name for n in ns if packing.node_matches(pinned["j-r0-0"], n)] == ["b", "c"]
    assert [n.name for n in ns if packing.node_matches(pinned["j-r0-3"], n)] == ["d", "e"]
    # A pin adds to the pod's own selector; a gang with no co-location is not pinned.
    chosen = dataclasses.replace(staged_pods()[0], node_selector=(("pool", "x"),))
    labelled = [dataclasses.replace(n, labels=(*n.labels, ("pool", "x"))) for n in ns]
    (one,) = packing.plan_admission(labelled, [], [], [request("j", [chosen])])
    assert one.pinned()[0].node_selector == (("pool", "x"), ("rack", "r0"))  # alone, it fits r0
    (plain,) = packing.plan_admission(ns, [], [], [request("p", [pod("p0", cpu="6"), pod("p1", cpu="6")])])
    assert plain.pins == {} and plain.pinned() == plain.request.pods


def test_the_admission_releases_and_creates_each_stage_pinned_to_its_rack():
    ns = mixed_racks()
    # A waiting gang: its ungating patches add each pod's rack.
    kube = MemoryKube()
    admitter = admitter_on(ns, kube)
    waiting = request("j", [dataclasses.replace(p, gated=True) for p in staged_pods()])
    admitter.informers = [Watch(*waiting.pods)]  # type: ignore[list-item]
    admitter.request(waiting)
    assert [a.request.name for a in asyncio.run(admitter.admit_once())] == ["j"]
    sent = {r.path.rsplit("/", 1)[1]: r.body["spec"] for r in kube.requests if r.verb == "PATCH"}
    assert {name: spec["nodeSelector"]["rack"] for name, spec in sent.items()} == {
        "j-r0-0": "r1", "j-r0-1": "r1", "j-r0-2": "r2", "j-r0-3": "r2"}
    # Until the watch shows the release, the admission counts the pods pinned, as they now are.
    ((_, counted),) = admitter.released.values()
    assert {p.name: dict(p.node_selector)["rack"] for p in counted} == {
        "j-r0-0": "r1", "j-r0-1": "r1", "j-r0-2": "r2", "j-r0-3": "r2"}
    # A new incarnation that fits is told its release, pins included, to create its pods with.
    admitter = admitter_on(ns)

    async def reserve() -> packing.GangRelease | None:
        asking = asyncio.create_task(admitter.reserve(request("j", staged_pods())))
        await asyncio.sleep(0)
        await admitter.admit_once()
        return await asking

    release = asyncio.run(reserve())
    assert release is not None and release.pins["j-r0-2"] == {"rack": "r2"}
    assert dict(admitter.reserved[("ns", "j")][2].node_selector)["rack"] == "r2"


def test_pipeline_stages_are_placed_one_rack_each():
    """The renderer's stage affinity (gang.topologyKey) is read back from the pods: each stage's
    pods go into one rack, or the gang does not fit."""
    pods = staged_pods()
    assert [p.colocated is not None and p.colocated[0] for p in pods] == ["rack"] * 4
    # Six 8-cpu nodes, one per rack: four fit by capacity, but no rack holds a stage's two pods.
    ns = nodes(*(node_body(f"n{i}", cpu="8", labels={"rack": f"r{i}"}) for i in range(6)))
    free = packing.free_capacity(ns, [])
    assert packing.place(pods, ns, free) is None and free == packing.free_capacity(ns, [])
    ns = mixed_racks()
    placement = packing.place(pods, ns, packing.free_capacity(ns, []))
    assert placement is not None
    assert {placement["j-r0-0"], placement["j-r0-1"]} == {"b", "c"}  # stage 0: the first rack that holds it
    assert {placement["j-r0-2"], placement["j-r0-3"]} == {"d", "e"}  # stage 1: the next


def test_taints_selectors_affinity_and_readiness():
    taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    ns = nodes(node_body("tainted", taints=[taint], labels={"pool": "gpu"}), node_body("down", ready=False),
               node_body("labelled", labels={"pool": "train"}))
    free = packing.free_capacity(ns, [])
    assert packing.place([pod("p")], ns, dict(free)) == {"p": "labelled"}
    tolerant = pod("t", tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                   selector={"pool": "gpu"})
    assert packing.place([tolerant], ns, dict(free)) == {"t": "tainted"}
    assert packing.place([pod("s", selector={"pool": "nope"})], ns, dict(free)) is None
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["train"]}]}]}}}
    assert packing.place([pod("a", affinity=affinity)], ns, dict(free)) == {"a": "labelled"}
    cordoned = node_body("c")
    cordoned["spec"]["unschedulable"] = True
    assert packing.place([pod("x")], nodes(cordoned), packing.free_capacity(nodes(cordoned), [])) is None
    assert packing.tolerates([{"operator": "Exists"}], taint)
    assert not packing.tolerates([{"key": "nvidia.com/gpu", "value": "absent"}], taint)


def test_two_gangs_that_fit_only_one_at_a_time_admit_the_older_one():
    ns = nodes(node_body("a", cpu="8"), node_body("b", cpu="8"))
    first = request("first", [pod("f0", cpu="6"), pod("f1", cpu="6")], age=1)
    second = request("second", [pod("s0", cpu="6"), pod("s1", cpu="6")], age=0)
    admitted = packing.plan_admission(ns, [], [], [first, second])
    assert [a.request.name for a in admitted] == ["second"]  # created earlier
    # Once released, the second gang is in flight: the first still does not fit.
    assert packing.plan_admission(ns, [], [list(second.pods)], [first]) == []
    # Bound and running, it still holds the capacity.
    bound = [pod("s0", cpu="6", node="a", phase="Running"), pod("s1", cpu="6", node="b", phase="Running")]
    assert packing.plan_admission(ns, bound, [], [first]) == []
    # When it finishes the first goes.
    done = [pod("s0", cpu="6", node="a", phase="Succeeded"), pod("s1", cpu="6", node="b", phase="Succeeded")]
    assert [a.request.name for a in packing.plan_admission(ns, done, [], [first])] == ["first"]


def test_a_later_small_gang_may_fill_room_the_head_cannot_use():
    ns = nodes(node_body("a", cpu="8"))
    big = request("big", [pod("b0", cpu="6"), pod("b1", cpu="6")], age=0)
    small = request("small", [pod("s0", cpu="2")], age=5)
    assert [a.request.name for a in packing.plan_admission(ns, [], [], [big, small])] == ["small"]


def test_a_gang_that_does_not_fit_leaves_no_trace_on_the_next_of_the_same_shape():
    ns = nodes(node_body("a", cpu="8"), node_body("b", cpu="8"), node_body("c", cpu="8"))
    flying = [pod("x0", cpu="6")]  # takes a: the plan remembers a is full for this shape
    big = request("big", [pod(f"b{i}", cpu="6") for i in range(3)], age=0)  # b and c, then nothing
    small = request("small", [pod(f"s{i}", cpu="6") for i in range(2)], age=1)
    admitted = packing.plan_admission(ns, [], [flying], [big, small])
    assert [(a.request.name, a.placement) for a in admitted] == [("small", {"s0": "b", "s1": "c"})]


def test_an_in_flight_gang_we_cannot_place_blocks_admission():
    ns = nodes(node_body("a", cpu="8"))
    stuck = [pod("x0", cpu="16")]
    assert packing.plan_admission(ns, [], [stuck], [request("w", [pod("w0", cpu="1")])]) == []


def test_in_flight_pods_no_node_may_take_or_being_deleted_hold_no_room():
    """A released gang whose nodes are gone (or NotReady), or whose pods are being deleted, binds
    nowhere: it must not freeze every other gang's admission until its timeout."""
    ns = nodes(node_body("a", cpu="8"), node_body("gone", cpu="8", ready=False))
    orphaned = [pod("o0", selector={"pool": "old"}),
                pod("o1", cpu="6", selector={"kubernetes.io/hostname": "gone"})]
    deleting = [dataclasses.replace(pod("d0", cpu="8"), deleting_since=T0)]
    waiting = request("w", [pod("w0", cpu="6")])
    for flying in (orphaned, deleting):
        assert [a.request.name for a in packing.plan_admission(ns, [], [flying], [waiting])] == ["w"], flying
    # Its pods that may still bind keep their room, and one that cannot fit still blocks.
    partly = [pod("p0", cpu="4"), pod("p1", selector={"pool": "old"})]
    assert packing.plan_admission(ns, [], [partly], [waiting]) == []
    assert [a.request.name for a in packing.plan_admission(ns, [], [partly],
                                                           [request("s", [pod("s0", cpu="4")])])] == ["s"]


def test_a_gang_bigger_than_the_cluster_never_goes():
    ns = nodes(node_body("a", cpu="8"), node_body("b", cpu="8"))
    assert packing.plan_admission(ns, [], [], [request("huge", [pod(f"h{i}", cpu="5")
                                                                for i in range(3)])]) == []


class Watch:
    """What the admission's pod informer holds (by namespace/name)."""

    def __init__(self, *pods: PodState):
        self.items = {f"{p.namespace}/{p.name}": p for p in pods}


def admitter_on(ns: list[NodeState], kube: object = None) -> GangAdmitter:
    return GangAdmitter(kube, lambda: ns, lambda key: None, OperatorMetrics(dict), asyncio.Semaphore(4), None)  # type: ignore[arg-type]


def member(p: PodState, job: str, **state: object) -> PodState:
    return dataclasses.replace(p, namespace="ns", job=job, **state)


real_plan = packing.plan_admission


def ask(admitter: GangAdmitter, *gangs: packing.GangRequest) -> list[bool]:
    """Whether each new gang may be created released: they ask, then one admission round answers."""
    async def run() -> list[bool]:
        asking = [asyncio.create_task(admitter.reserve(g)) for g in gangs]
        await asyncio.sleep(0)
        await admitter.admit_once()
        return [await a is not None for a in asking]

    return asyncio.run(run())


def test_gangs_that_ask_at_creation_never_overcommit_and_count_until_the_watch_shows_them():
    ns = nodes(node_body("a", cpu="8"), node_body("b", cpu="8"))
    admitter = admitter_on(ns)
    gangs = [request(f"g{i}", [member(pod(f"g{i}-0", cpu="6"), f"g{i}"),
                               member(pod(f"g{i}-1", cpu="6"), f"g{i}")], age=i)
             for i in range(3)]

    # Each fits alone, only one at a time: the oldest goes, released; the others are created gated.
    assert ask(admitter, *reversed(gangs)) == [False, False, True]
    assert set(admitter.reserved) == {("ns", "g0")}
    # While its pods are being created it holds the room: a gang asking now is refused.
    late = request("late", [member(pod("l0", cpu="6"), "late")], age=9)
    assert ask(admitter, late)[0] is False
    # Created, but the watch does not show them yet: still counted, from memory.
    admitter.unreserve(("ns", "g0"))
    assert ask(admitter, late)[0] is False
    # The watch shows them released and unbound, then bound: counted from the watch.
    shown = [dataclasses.replace(p, released=True) for p in gangs[0].pods]
    admitter.informers = [Watch(*shown)]  # type: ignore[list-item]
    assert ask(admitter, late)[0] is False and not admitter.released
    admitter.informers = [Watch(*(dataclasses.replace(p, node=n, phase="Running")  # type: ignore[list-item]
                                  for p, n in zip(shown, "ab", strict=True)))]
    assert ask(admitter, late)[0] is False
    # They end (the informer keeps the operator's finished pods): the room is free.
    admitter.informers = [Watch(*(dataclasses.replace(p, node=n, phase="Succeeded")  # type: ignore[list-item]
                                  for p, n in zip(shown, "ab", strict=True)))]
    assert ask(admitter, late)[0] is True


def test_new_gangs_asking_together_are_answered_by_one_plan(monkeypatch):
    admitter = admitter_on(nodes(node_body("a", cpu="8"), node_body("b", cpu="8")))
    gangs = [request(f"g{i}", [member(pod(f"g{i}-0", cpu="6"), f"g{i}")], age=i) for i in range(3)]
    plans = []
    monkeypatch.setattr(packing, "plan_admission", lambda *a: plans.append(a) or real_plan(*a))

    async def run() -> list[bool]:
        rounds = asyncio.create_task(admitter.run())  # the operator's one admission loop
        try:
            answers = await asyncio.wait_for(asyncio.gather(*(admitter.reserve(g) for g in gangs)), 10)
            return [a is not None for a in answers]
        finally:
            rounds.cancel()

    assert asyncio.run(run()) == [True, True, False]
    assert len(plans) == 1 and set(admitter.reserved) == {("ns", "g0"), ("ns", "g1")}


def test_a_round_that_fails_answers_no_and_the_gang_is_created_gated():
    def broken() -> list[NodeState]:
        raise RuntimeError("a bug in a round")

    admitter = GangAdmitter(None, broken, lambda key: None, OperatorMetrics(dict), asyncio.Semaphore(4), None)  # type: ignore[arg-type]

    async def run() -> bool:
        asking = asyncio.create_task(admitter.reserve(request("asking",
                                                              [member(pod("a-0", cpu="6"), "asking")])))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError):
            await admitter.admit_once()
        return await asking is not None

    assert asyncio.run(run()) is False
    assert not admitter.asks and not admitter.reserved


def test_a_gang_whose_loop_stops_while_it_asks_holds_no_room():
    admitter = admitter_on(nodes(node_body("a", cpu="8")))
    stopped, later = (request(n, [member(pod(f"{n}-0", cpu="6"), n)], age=i)
                      for i, n in enumerate(("stopped", "later")))

    async def stop_asking() -> None:
        asking = asyncio.create_task(admitter.reserve(stopped))
        await asyncio.sleep(0)
        asking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asking

    async def stop_when_answered() -> None:  # the round said yes; the loop stops before it reads that
        asking = asyncio.create_task(admitter.reserve(stopped))
        await asyncio.sleep(0)
        await admitter.admit_once()
        assert set(admitter.reserved) == {("ns", "stopped")}
        asking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asking

    for stop in (stop_asking, stop_when_answered):
        asyncio.run(stop())
        assert not admitter.asks and not admitter.reserved, stop
    assert ask(admitter, later) == [True] and set(admitter.reserved) == {("ns", "later")}


def test_a_gang_being_created_that_the_watch_shows_in_part_is_counted_once():
    # A full cluster: the gang being created takes two of four nodes, the other two are free.
    ns = nodes(*(node_body(n, cpu="8") for n in "abcd"))
    admitter = admitter_on(ns)
    creating = request("creating", [member(pod(f"c{i}", cpu="6"), "creating") for i in range(2)])
    assert ask(admitter, creating)[0]
    # The watch shows its first pod (created released) while the second is being created:
    # that pod is counted once, not once from the watch and again from memory.
    admitter.informers = [Watch(dataclasses.replace(creating.pods[0], released=True))]  # type: ignore[list-item]
    second = request("second", [member(pod(f"s{i}", cpu="6"), "second") for i in range(2)], age=1)
    assert ask(admitter, second)[0]
    # Both hold their room: a third finds none.
    third = request("third", [member(pod("t0", cpu="6"), "third")], age=2)
    assert not ask(admitter, third)[0]
    # The first pod is bound where the plan did not put it: it counts as bound, still once.
    admitter.informers = [Watch(dataclasses.replace(creating.pods[0], released=True, node="d",  # type: ignore[list-item]
                                                    phase="Running"))]
    assert not ask(admitter, third)[0]


def test_a_new_incarnation_takes_the_room_of_its_last_one_that_the_watch_still_shows():
    """At a restart the job's loop creates the new gang once a LIST shows the last one gone; the watch
    may still show its pods bound a moment longer. They do not hold the new gang's room; another job's
    pods, or a pod of the same job's current incarnation, do."""
    ns = nodes(node_body("a", cpu="8"), node_body("b", cpu="8"))
    admitter = admitter_on(ns)
    lagging = [member(pod(f"j-r0-{i}", cpu="6", node=n, phase="Running"), "j", restart=0)
               for i, n in enumerate("ab")]
    admitter.informers = [Watch(*lagging)]  # type: ignore[list-item]
    restart = packing.GangRequest("ns", "j", T0, 1, tuple(
        member(pod(f"j-r1-{i}", cpu="6"), "j", restart=1) for i in range(2)))
    assert ask(admitter, restart) == [True]
    admitter.unreserve(("ns", "j"))
    other = packing.GangRequest("ns", "k", T0, 1, tuple(
        member(pod(f"k-r1-{i}", cpu="6"), "k", restart=1) for i in range(2)))
    fresh = admitter_on(ns)
    fresh.informers = [Watch(*lagging)]  # type: ignore[list-item]
    assert ask(fresh, other) == [False], "job j's pods are not job k's to take"
    same = admitter_on(ns)
    same.informers = [Watch(*(dataclasses.replace(p, restart=1) for p in lagging))]  # type: ignore[list-item]
    assert ask(same, restart) == [False], "pods of the asking incarnation itself hold their room"


def test_a_new_incarnation_takes_the_room_of_its_last_one_this_admitter_still_remembers_released():
    """The last incarnation was created released and failed before the watch showed it (or before any
    round looked): its memory of that release must not hold the restart's room."""
    ns = nodes(node_body("a", cpu="8"), node_body("b", cpu="8"))
    admitter = admitter_on(ns)
    first = packing.GangRequest("ns", "j", T0, 0, tuple(
        member(pod(f"j-r0-{i}", cpu="6"), "j", restart=0) for i in range(2)))
    assert ask(admitter, first) == [True]
    admitter.unreserve(("ns", "j"))  # created; the watch never showed it, and now it is gone
    restart = packing.GangRequest("ns", "j", T0, 1, tuple(
        member(pod(f"j-r1-{i}", cpu="6"), "j", restart=1) for i in range(2)))
    assert ask(admitter, restart) == [True]
    other = packing.GangRequest("ns", "k", T0, 0, (member(pod("k-0", cpu="6"), "k"),))
    assert ask(admitter, other) == [False], "the restart's gang holds its room"


def test_the_admission_runs_again_when_a_pod_is_released_bound_or_gone_while_a_gang_waits():
    admitter = admitter_on(nodes(node_body("a", cpu="8")))
    admitter.request(request("waiting", [member(pod("w0", cpu="6"), "waiting", gated=True)]))
    admitter._kick.clear()
    other = member(pod("o0", cpu="6"), "other", released=True)
    admitter.on_pod_change(other, dataclasses.replace(other, phase="Running"))
    admitter.on_pod_change(None, other)
    ended = dataclasses.replace(other, phase="Failed")
    admitter.on_pod_change(ended, None)
    assert not admitter._kick.is_set(), "changes the plan does not see: a new pod, a finished one going"
    for new in (dataclasses.replace(other, node="a"), dataclasses.replace(other, gated=True), ended, None):
        admitter.on_pod_change(other, new)
        assert admitter._kick.is_set(), new
        admitter._kick.clear()


def test_a_gang_released_is_counted_until_the_watch_shows_its_gates_gone():
    ns = nodes(node_body("a", cpu="8"), node_body("b", cpu="8"))
    kube = MemoryKube()  # holds none of the pods: the watch shows no ungating until a test says so
    admitter = admitter_on(ns, kube)
    first = request("first", [member(pod(f"f{i}", cpu="6"), "first", gated=True) for i in range(2)], age=0)
    second = request("second", [member(pod(f"s{i}", cpu="6"), "second", gated=True) for i in range(2)], age=1)
    admitter.informers = [Watch(*first.pods, *second.pods)]  # type: ignore[list-item]
    admitter.request(first)
    admitter.request(second)
    assert [a.request.name for a in asyncio.run(admitter.admit_once())] == ["first"]
    assert patched(kube) == ["f0", "f1"]
    # The watch lags: it still shows the first gang gated. It is neither released again nor
    # forgotten, so the second, which fits only without it, waits.
    admitter.request(first)  # its loop asks again from the same lagging view
    assert asyncio.run(admitter.admit_once()) == [] and patched(kube) == ["f0", "f1"]
    # The watch catches up (released, unbound): still no room for the second.
    admitter.informers = [Watch(*(dataclasses.replace(p, gated=False, released=True) for p in first.pods),  # type: ignore[list-item]
                                *second.pods)]
    assert asyncio.run(admitter.admit_once()) == [] and not admitter.released
    # The first gang ends: the second goes.
    admitter.informers = [Watch(*second.pods)]  # type: ignore[list-item]
    assert [a.request.name for a in asyncio.run(admitter.admit_once())] == ["second"]


def released_alone() -> tuple[GangAdmitter, packing.GangRequest]:
    """An admitter that has just released gang "first" (two pods of 6 cpus, on two nodes of 8), when no
    other gang waits: no round will run until one asks."""
    ns = nodes(node_body("a", cpu="8"), node_body("b", cpu="8"))
    admitter = admitter_on(ns, MemoryKube())
    first = request("first", [member(pod(f"f{i}", cpu="6"), "first", gated=True) for i in range(2)])
    admitter.informers = [Watch(*first.pods)]  # type: ignore[list-item]
    admitter.request(first)
    assert [a.request.name for a in asyncio.run(admitter.admit_once())] == ["first"]
    return admitter, first


def test_a_released_gang_whose_pods_ended_before_the_next_round_holds_no_room():
    """No round reads the watch between a release and the end of the gang's pods (no gang waits):
    the next round, a new gang's ask, finds them ended, not still to be shown released."""
    admitter, first = released_alone()
    # The watch next shows its pods bound and succeeded (the informer keeps the operator's own).
    ended = (dataclasses.replace(p, gated=False, released=True, node=n, phase="Succeeded")
             for p, n in zip(first.pods, "ab", strict=True))
    admitter.informers = [Watch(*ended)]  # type: ignore[list-item]
    second = request("second", [member(pod(f"s{i}", cpu="6"), "second") for i in range(2)], age=1)
    assert ask(admitter, second) == [True] and not admitter.released


def test_a_released_gang_whose_pods_were_deleted_before_the_watch_showed_them_released_holds_no_room():
    """The job was deleted right after its release: the watch shows its pods deleted, never released,
    and the next job that fits is created released at once, not 30 s later."""
    admitter, first = released_alone()
    admitter.informers = [Watch()]  # type: ignore[list-item]
    second = request("second", [member(pod(f"s{i}", cpu="6"), "second") for i in range(2)], age=1)
    admitter.on_pod_change(first.pods[0], None)
    assert ask(admitter, second) == [False], "one pod of the first gang is not shown deleted yet"
    admitter.on_pod_change(first.pods[1], None)
    assert ask(admitter, second) == [True] and not admitter.released and not admitter.deleted


def test_a_deleted_pod_of_an_earlier_gang_does_not_count_for_a_new_release_of_the_same_name():
    ns = nodes(node_body("a", cpu="8"))
    admitter = admitter_on(ns, MemoryKube())
    old = member(pod("p0", cpu="6"), "job", gated=True)
    admitter.released[(("default", "job"), 0)] = (admitter.monotonic(), (old,))
    admitter.on_pod_change(old, None)
    assert admitter.deleted == {(old.namespace, "p0")}
    again = dataclasses.replace(old, uid="new-uid")
    admitter._remember_release((("default", "job"), 0), (again,))
    assert not admitter.deleted and admitter._released_unseen({}) == [(again,)]


def patched(kube: MemoryKube) -> list[str]:
    """The pods the admission sent an ungating patch."""
    return [r.path.rsplit("/", 1)[1] for r in kube.requests if r.verb == "PATCH"]


def reviewing(allowed: set[tuple[str, str]]) -> MemoryKube:
    """A Kubernetes that lets the operator list and watch pods where `allowed` says (verb, namespace;
    "" for every namespace)."""
    kube = MemoryKube()
    kube.grants = {(verb, "pods", namespace) for verb, namespace in allowed}
    return kube


def asked(kube: MemoryKube) -> list[tuple[str, str]]:
    """The SelfSubjectAccessReviews the operator sent: (verb, namespace) of pods."""
    reviews = [r.body["spec"]["resourceAttributes"] for r in kube.requests
               if r.path == "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"]
    assert all(a["resource"] == "pods" for a in reviews)
    return [(a["verb"], a["namespace"]) for a in reviews]


def test_the_admission_asks_the_api_server_for_both_list_and_watch_before_choosing_its_scope():
    kube = reviewing({("list", ""), ("watch", ""), ("list", "a")})
    admitter = GangAdmitter(kube, list, lambda key: None, OperatorMetrics(dict), asyncio.Semaphore(1), ["a"])
    assert asyncio.run(admitter.may_watch_pods(None))
    assert not asyncio.run(admitter.may_watch_pods("a")), "list without watch is not enough"
    assert asked(kube) == [("list", ""), ("watch", ""), ("list", "a"), ("watch", "a")]
    assert asyncio.run(admitter.scopes()) == [None], "cluster-wide where it may"
    namespaced = GangAdmitter(reviewing({("list", "a"), ("watch", "a")}), list, lambda key: None,
                              OperatorMetrics(dict), asyncio.Semaphore(1), ["a"])
    assert asyncio.run(namespaced.scopes()) == ["a"], "else in the watched namespaces"


@pytest.mark.parametrize(("namespaces", "allowed", "named"), [
    (None, {("list", "a"), ("watch", "a")}, "in every namespace"),  # cluster mode needs the cluster-wide rule
    (["a", "b"], {("list", ""), ("list", "a"), ("watch", "a"), ("list", "b")}, "pods in b:"),
])
def test_an_admission_that_may_not_watch_pods_stops_the_start_naming_the_rule(namespaces, allowed, named):
    admitter = GangAdmitter(reviewing(allowed), list, lambda key: None, OperatorMetrics(dict),
                            asyncio.Semaphore(1), namespaces)
    with pytest.raises(PermissionError, match=named):
        asyncio.run(admitter.scopes())


def test_room_counts_the_pods_like_one_that_fit_beside_bound_pods_and_released_gangs():
    ns = nodes(node_body("a", cpu="8"), node_body("b", cpu="8"), node_body("c", cpu="4"),
               node_body("down", cpu="64", ready=False))
    like = pod("job-r0-0", cpu="4")
    assert packing.room(ns, [], [], like, limit=10) == 5  # 2 + 2 + 1; a NotReady node takes none
    assert packing.room(ns, [], [], like, limit=3) == 3
    bound = [pod("other", cpu="6", node="a", phase="Running")]
    assert packing.room(ns, bound, [], like, limit=10) == 3
    released = [[pod("g-0", cpu="8"), pod("g-1", cpu="4")]]  # released, not yet bound: b and c are theirs
    assert packing.room(ns, bound, released, like, limit=10) == 0
