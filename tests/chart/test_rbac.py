"""The chart's RBAC grants what each gang backend has the operator do (tetrad.render.gangs): apply
its group objects, delete an earlier incarnation's, read the object that says why a gang waits.
Read from the template's text, without helm: a new backend without its rules fails the fast lane."""

from __future__ import annotations

import re

import pytest

from tests.api.helpers import manifest
from tests.chart.test_chart import CHART
from tetrad.api import parse
from tetrad.render import gangs, render

RULE = re.compile(r"^- apiGroups: \[(.*)\]\n  resources: \[(.*)\]\n  verbs: \[(.*)\]$", re.MULTILINE)


def granted() -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) -> verbs, over every rule of the template."""
    out: dict[tuple[str, str], set[str]] = {}
    for groups, resources, verbs in RULE.findall((CHART / "templates" / "rbac.yaml").read_text()):
        for group in groups.split(","):
            for resource in resources.split(","):
                key = (group.strip().strip('"'), resource.strip())
                out.setdefault(key, set()).update(v.strip() for v in verbs.split(","))
    return out


def group_of(api_version: str) -> str:
    return api_version.rpartition("/")[0]


def test_the_template_is_read():
    assert granted()[("", "pods")] >= {"list", "watch", "create", "delete", "patch"}


@pytest.mark.parametrize("scheduler", sorted(gangs.BACKENDS))
def test_the_chart_grants_what_each_gang_backend_needs(scheduler):
    backend = gangs.BACKENDS[scheduler]
    doc = manifest(gang={"scheduler": scheduler.value, "queue": "q"})
    doc["metadata"]["uid"] = "u"
    job, problems = parse(doc)
    assert job is not None, problems
    rules = granted()
    needed = {"get", "patch"} | ({"deletecollection"} if backend.group_per_incarnation else set())
    for obj in render(job).gang_objects():
        resource = (group_of(obj["apiVersion"]), obj["kind"].lower() + "s")
        assert rules.get(resource, set()) >= needed, (
            f"{scheduler.value}: the chart's RBAC lacks {resource} {needed}")
    if backend.queue_object is not None:
        api_version, plural = backend.queue_object
        assert "get" in rules.get((group_of(api_version), plural), set()), (
            f"{scheduler.value}: cannot read {plural}")
