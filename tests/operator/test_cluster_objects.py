"""The objects the operator writes, against a real API server: the Service, ConfigMap and PodGroup
by server-side apply (field manager `tetrad-operator`), a foreign object of the same name left
alone with an ObjectConflict event, and pods the API server refuses ending the job.
"""

from __future__ import annotations

import json

import pytest
from tetrad_operator.controller import FIELD_MANAGER

from .fakes import EXTRA_LABEL, older_renderer
from .helpers import condition, ptj, terminate, wait_events, wait_for, wait_phase, wait_running

pytestmark = pytest.mark.cluster


def test_a_field_the_operator_stops_rendering_leaves_the_object(api, operator, namespace, monkeypatch):
    ns = namespace
    extra = older_renderer(monkeypatch)  # the renderer of an older operator version, then of this one
    api.create_job(ns, ptj("applied", nodes=2, runPolicy={"maxRestarts": 2}))
    wait_running(api, ns, "applied", 2)
    cm = api.get(f"/api/v1/namespaces/{ns}/configmaps/applied-config")
    svc = api.get(f"/api/v1/namespaces/{ns}/services/applied")
    assert cm["data"]["extra.json"] == "{}" and svc["metadata"]["labels"][EXTRA_LABEL] == "yes"
    ports = [p["name"] for p in svc["spec"]["ports"]]
    assert "extra" in ports and len(ports) > 1
    for obj in (cm, svc):
        managers = {(m["manager"], m["operation"]) for m in obj["metadata"]["managedFields"]}
        assert (FIELD_MANAGER, "Apply") in managers, managers

    extra["on"] = False
    terminate(api, ns, "applied-r0-1", 1)  # the next incarnation applies the objects again
    wait_running(api, ns, "applied", 2, restart=1)
    cm = api.get(f"/api/v1/namespaces/{ns}/configmaps/applied-config")
    svc = api.get(f"/api/v1/namespaces/{ns}/services/applied")
    assert set(cm["data"]) == {"config.json"}, "the field the operator stopped rendering is gone"
    assert json.loads(cm["data"]["config.json"])["nodes"] == 2
    assert EXTRA_LABEL not in svc["metadata"]["labels"]
    assert [p["name"] for p in svc["spec"]["ports"]] == [p for p in ports if p != "extra"]
    assert svc["spec"]["clusterIP"] == "None", "what the operator still renders stays"


def test_a_foreign_object_of_the_same_name_is_left_alone_with_an_event(api, operator, namespace):
    ns = namespace
    foreign = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "taken-config"},
               "data": {"mine": "1"}}
    api.create(f"/api/v1/namespaces/{ns}/configmaps", foreign)
    api.create_job(ns, ptj("taken", nodes=2))

    wait_for(lambda: [e for e in api.events(ns, "taken") if e["reason"] == "ObjectConflict"],
             what="ObjectConflict")
    event = next(e for e in api.events(ns, "taken") if e["reason"] == "ObjectConflict")
    assert event["type"] == "Warning"
    assert event["message"] == ("ConfigMap taken-config exists and is not owned by this job; "
                                "delete it or rename the job")
    cm = api.get(f"/api/v1/namespaces/{ns}/configmaps/taken-config")
    assert cm["data"] == {"mine": "1"} and not cm["metadata"].get("ownerReferences")
    assert not any(m["manager"] == FIELD_MANAGER for m in cm["metadata"]["managedFields"])
    assert not api.pods(ns, "taken"), "no pod starts without its own ConfigMap"
    assert api.status(ns, "taken")["phase"] == "Pending"

    api.delete(f"/api/v1/namespaces/{ns}/configmaps/taken-config")  # the user resolves the conflict
    wait_running(api, ns, "taken", 2, timeout=60)
    cm = api.get(f"/api/v1/namespaces/{ns}/configmaps/taken-config")
    assert "config.json" in cm["data"] and cm["metadata"]["ownerReferences"][0]["name"] == "taken"


def test_pods_a_resource_quota_refuses_fail_the_job_with_the_api_servers_message(api, operator, namespace):
    ns = namespace
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-pods"},
             "spec": {"hard": {"pods": "0"}}}
    api.create(f"/api/v1/namespaces/{ns}/resourcequotas", quota)
    wait_for(lambda: (api.get(f"/api/v1/namespaces/{ns}/resourcequotas/no-pods").get("status")
                      or {}).get("hard"),
             what="the quota controller to fill the quota's status")
    api.create_job(ns, ptj("quota", nodes=2))

    st = wait_phase(api, ns, "quota", "Failed", timeout=60)
    failed = condition(st, "Failed")
    assert failed["reason"] == "PodCreationRejected"
    assert st["message"].startswith("the API server rejected the job's pods 3 times in a row: ")
    assert "exceeded quota: no-pods" in st["message"], st["message"]
    assert not api.pods(ns, "quota")
    refused = wait_events(api, ns, "quota", "FailedCreatePod")
    assert (refused and "exceeded quota" in refused[0]["message"]
            and "1 more pods refused alike" in refused[0]["message"])
    assert all(e["type"] == "Warning" for e in wait_events(api, ns, "quota", "PodCreationRejected"))
