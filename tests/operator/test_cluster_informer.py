"""The operator's informer against the real API server: changes arrive as (old, new) views grouped
by job, and a LIST after a gap, or after the server forgot the watch's version, tells what went
meanwhile."""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.request import Request, urlopen

import pytest
from tetrad_operator.controller import job_key, pod_view
from tetrad_operator.informer import Informer
from tetrad_operator.kube import Kube, load_configuration
from tetrad_operator.kubeapi import Gone, path
from tetrad_operator.observed import PodState

from tetrad.api import contract

pytestmark = pytest.mark.cluster


def fake_pod(name: str, job: str | None) -> dict[str, Any]:
    """A pod no node selects (it stays Pending), labelled as Tetrad's with its job when it has one."""
    labels = {contract.LABEL_JOB: job, contract.LABEL_MANAGED_BY: contract.MANAGED_BY} if job else {}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": labels},
            "spec": {"nodeSelector": {"tetrad.dev/test": "nowhere"},
                     "containers": [{"name": "c", "image": "registry.invalid/none"}]}}


def kube_for(cluster: Any) -> Kube:
    return Kube(load_configuration(str(cluster.kubeconfig)), workers=4)


async def until(check: Any, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_changes_arrive_as_old_and_new_views_grouped_by_job(operator_cluster, api, namespace):
    async def run() -> list[tuple[Any, Any]]:
        kube = kube_for(operator_cluster)
        seen: list[tuple[Any, Any]] = []
        informer = Informer(kube, path("v1", "pods", namespace), PodState.from_body,
                            lambda o, n: seen.append((o, n)),
                            selector=contract.LABEL_JOB, group=lambda p: (p.namespace, p.job))
        task = asyncio.create_task(informer.run())
        try:
            await asyncio.wait_for(informer.synced.wait(), 30)
            assert informer.items == {} and seen == []
            api.create(f"/api/v1/namespaces/{namespace}/pods", fake_pod("w-0", job="w"))
            api.create(f"/api/v1/namespaces/{namespace}/pods", fake_pod("other", job=None))  # not selected
            await until(lambda: informer.group((namespace, "w")))
            assert [p.name for p in informer.group((namespace, "w"))] == ["w-0"]
            api.patch(f"/api/v1/namespaces/{namespace}/pods/w-0",
                      {"metadata": {"annotations": {contract.ANNOTATION_CHECKPOINT_NOW: "t1"}}})
            await until(lambda: informer.group((namespace, "w"))[0].checkpoint_request == "t1")
            api.delete(f"/api/v1/namespaces/{namespace}/pods/w-0", gracePeriodSeconds=0)
            await until(lambda: seen[-1][1] is None)
            assert informer.group((namespace, "w")) == [] and informer.groups == {} and informer.items == {}
            return seen
        finally:
            task.cancel()
            await kube.close()

    seen = asyncio.run(run())
    assert seen[0][0] is None and seen[0][1].name == "w-0" and seen[0][1].job == "w"
    assert all(new is None or new.name == "w-0" for _, new in seen)  # the unlabelled pod never came
    # each old is the last new
    assert all(old == before for (_, before), (old, _) in zip(seen, seen[1:], strict=False))
    marked = next(i for i, (_, new) in enumerate(seen) if new is not None and new.checkpoint_request == "t1")
    assert seen[marked][0].checkpoint_request is None
    assert seen[-1][0].name == "w-0" and seen[-1][1] is None


def test_a_list_after_a_gap_tells_what_went_meanwhile(operator_cluster, api, namespace):
    """The first LIST replaces what the store held: an object it lacks is reported gone."""
    async def run() -> list[tuple[Any, Any]]:
        kube = kube_for(operator_cluster)
        seen: list[tuple[Any, Any]] = []
        # What the first LIST told: a watch event after it (the scheduler touching the pod) is not its.
        informer = Informer(kube, path("v1", "pods", namespace), PodState.from_body,
                            lambda o, n: None if informer.synced.is_set() else seen.append((o, n)),
                            group=lambda p: p.job)
        stale = PodState(name="gone-0", uid="u-gone", job="gone", restart=0, rank=0, phase="Running",
                         namespace=namespace)
        informer._put(f"{namespace}/gone-0", stale)
        api.create(f"/api/v1/namespaces/{namespace}/pods", fake_pod("kept-0", job="kept"))
        seen.clear()
        task = asyncio.create_task(informer.run())
        try:
            await asyncio.wait_for(informer.synced.wait(), 30)
            return seen
        finally:
            task.cancel()
            await kube.close()

    seen = asyncio.run(run())
    assert [(o and o.name, n and n.name) for o, n in seen] == [("gone-0", None), (None, "kept-0")]


def test_the_operators_one_pod_watch_keeps_its_finished_pods_and_lets_anothers_go(
        operator_cluster, api, namespace):
    """The job loops need their finished pods; the gang admission needs every pod that takes room."""
    async def run() -> dict[str, Any]:
        kube = kube_for(operator_cluster)
        gone: list[str] = []
        informer = Informer(kube, path("v1", "pods", namespace), pod_view,
                            lambda o, n: gone.append(o.name) if o is not None and n is None else None,
                            group=job_key)
        task = asyncio.create_task(informer.run())
        try:
            await asyncio.wait_for(informer.synced.wait(), 30)
            for name, job in (("ours-0", "ours"), ("theirs", None)):
                api.create(f"/api/v1/namespaces/{namespace}/pods", fake_pod(name, job=job))
            await until(lambda: len(informer.items) == 2)
            assert informer.groups == {
                (namespace, "ours"): {f"{namespace}/ours-0": informer.items[f"{namespace}/ours-0"]}}
            for name in ("ours-0", "theirs"):
                api.patch(f"/api/v1/namespaces/{namespace}/pods/{name}/status",
                          {"status": {"phase": "Succeeded"}})
            await until(lambda: gone == ["theirs"] and informer.items[f"{namespace}/ours-0"].terminal)
            return informer.items
        finally:
            task.cancel()
            await kube.close()

    assert list(asyncio.run(run())) == [f"{namespace}/ours-0"]


def compact_etcd(cluster: Any) -> None:
    """Forget every older revision, as the API server has etcd do every five minutes."""
    url = f"http://127.0.0.1:{cluster.env['ETCD_PORT']}/v3/kv"
    with urlopen(Request(f"{url}/range", data=b'{"key": "AA=="}')) as rsp:
        revision = json.load(rsp)["header"]["revision"]
    with urlopen(Request(f"{url}/compaction",
                         data=json.dumps({"revision": revision, "physical": True}).encode())):
        pass


def event(name: str, namespace: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Event", "metadata": {"name": name},
            "involvedObject": {"kind": "Pod", "name": "p", "namespace": namespace}, "reason": "Test",
            "message": name}


class Forgetful(Informer[str]):
    """Its first watch starts from a version etcd has forgotten, as after a long disconnection;
    later LISTs are as usual."""

    lists = 0

    async def _relist(self) -> str:
        version = await super()._relist()
        self.lists += 1
        return "1" if self.lists == 1 else version


def test_a_watch_from_a_forgotten_version_lists_again_and_tells_what_changed_meanwhile(
        operator_cluster, api, namespace):
    """410 Gone from the real API server: the watch raises Gone, the informer lists again, and a
    change made in between arrives as a difference of the new LIST. Events, because the API
    server keeps no watch cache for them: their watches read etcd, whose history is compacted."""
    compact_etcd(operator_cluster)
    events = f"/api/v1/namespaces/{namespace}/events"

    async def run() -> tuple[Forgetful, list[tuple[Any, Any]]]:
        kube = kube_for(operator_cluster)
        with pytest.raises(Gone):
            async with asyncio.timeout(30):
                async for _ in kube.watch(events, "1"):
                    pass
        api.create(events, event("early", namespace))
        seen: list[tuple[Any, Any]] = []

        def on_change(old: str | None, new: str | None) -> None:
            seen.append((old, new))
            if len(seen) == 1:  # between the first LIST and its watch, which the server refuses
                api.delete(f"{events}/early")
                api.create(events, event("late", namespace))

        informer = Forgetful(kube, events, lambda body: body["metadata"]["name"], on_change)
        task = asyncio.create_task(informer.run())
        try:
            await until(lambda: informer.lists == 2 and seen[-1] == (None, "late"))
            api.create(events, event("later", namespace))  # the watch goes on from the new LIST
            await until(lambda: seen[-1] == (None, "later"))
            return informer, seen
        finally:
            task.cancel()
            await kube.close()

    informer, seen = asyncio.run(run())
    assert informer.lists == 2
    assert sorted(informer.items.values()) == ["late", "later"]
    assert seen == [(None, "early"), ("early", None), (None, "late"), (None, "later")]
