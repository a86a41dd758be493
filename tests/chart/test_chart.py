"""The helm chart, rendered by the real helm binary: lint, what each setting renders, and the
values schema. tests/operator/test_cluster_operator.py installs it into the real apiserver."""

from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from tetrad_operator.settings import OperatorSettings

from tetrad.api import parse
from tetrad.render.command import INSTALLED_LAUNCHER, node_command
from tetrad.render.objects import CONFIG_PATH, PYTHON
from tetrad.resolve import resolve

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tetrad"

pytestmark = pytest.mark.cluster  # needs the pinned helm that hack/k8s-tools.sh builds


def helm(k8s_tools: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(k8s_tools / "helm"), *args], capture_output=True, text=True, timeout=120)


def render(k8s_tools: Path, *sets: str,
           namespace: str = "tetrad-system") -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name-or-namespace/name) -> object, for `helm template tetrad CHART --set ...`."""
    proc = helm(k8s_tools, "template", "tetrad", str(CHART), "-n", namespace,
                *[a for s in sets for a in ("--set", s)])
    assert proc.returncode == 0, proc.stderr
    objects = {}
    for doc in yaml.safe_load_all(proc.stdout):
        if doc:
            meta = doc["metadata"]
            key = (f"{meta['namespace']}/{meta['name']}"
                   if doc["kind"] in ("Role", "RoleBinding", "KopfPeering") else meta["name"])
            objects[(doc["kind"], key)] = doc
    return objects


def container(objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    return objects[("Deployment", "tetrad")]["spec"]["template"]["spec"]["containers"][0]


def rules(role: dict[str, Any]) -> dict[str, set[str]]:
    return {f"{g}/{r}": set(rule["verbs"])
            for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}


def test_lint_is_clean(k8s_tools):
    proc = helm(k8s_tools, "lint", "--strict", str(CHART))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_chart_ships_the_crds_of_crds_dir(k8s_tools):
    proc = helm(k8s_tools, "show", "crds", str(CHART))
    shipped = {d["metadata"]["name"] for d in yaml.safe_load_all(proc.stdout) if d}
    assert shipped == {"paralleltrainingjobs.tetrad.dev", "clusterkopfpeerings.kopf.dev",
                       "kopfpeerings.kopf.dev"}
    ours = (REPO / "crds" / "tetrad.dev_paralleltrainingjobs.yaml").read_text()
    assert ours in proc.stdout  # the same bytes: crds/ is the one source


def test_default_manages_every_namespace_with_two_peered_replicas(k8s_tools):
    objects = render(k8s_tools)
    c = container(objects)
    assert c["command"] == ["tetrad", "operator"]
    assert c["args"] == ["--all-namespaces", "--peering=tetrad", "--metrics-port=8080"]
    assert objects[("Deployment", "tetrad")]["spec"]["replicas"] == 2
    assert ("ClusterKopfPeering", "tetrad") in objects
    assert objects[("PodDisruptionBudget", "tetrad")]["spec"]["minAvailable"] == 1
    assert {"kopf.dev/clusterkopfpeerings": {"get", "list", "watch", "patch"}}.items() <= \
        rules(objects[("ClusterRole", "tetrad-cluster")]).items()
    writes = rules(objects[("ClusterRole", "tetrad")])
    assert writes["/pods"] == {"list", "watch", "create", "delete", "patch"}
    assert not any("secrets" in r or "*" in r for r in writes), writes
    assert objects[("ClusterRoleBinding", "tetrad")]["subjects"] == [
        {"kind": "ServiceAccount", "name": "tetrad", "namespace": "tetrad-system"}]
    assert not [k for k in objects if k[0] in ("Role", "RoleBinding")]


def test_the_pod_is_locked_down_and_probed(k8s_tools):
    objects = render(k8s_tools)
    pod = objects[("Deployment", "tetrad")]["spec"]["template"]["spec"]
    c = container(objects)
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["seccompProfile"] == {
        "type": "RuntimeDefault"}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]  # the only writable path
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["TETRAD_OPERATOR_LIVENESS"] == "http://0.0.0.0:8081/healthz"
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    probe = c["livenessProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 120, "late answers on a loaded node"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"metrics": 8080, "health": 8081}
    assert c["image"] == "tetrad/operator:0.1.0"
    service = objects[("Service", "tetrad-metrics")]
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 8080, "targetPort": "metrics"}]
    assert service["spec"]["selector"] == objects[("Deployment", "tetrad")]["spec"]["selector"]["matchLabels"]


def test_watch_namespaces_gives_a_role_and_a_peering_in_each(k8s_tools):
    objects = render(k8s_tools, "watchNamespaces={team-a,team-b}")
    assert container(objects)["args"] == ["--namespace=team-a", "--namespace=team-b", "--peering=tetrad",
                                          "--metrics-port=8080"]
    for ns in ("team-a", "team-b"):
        role = rules(objects[("Role", f"{ns}/tetrad")])
        assert role["kopf.dev/kopfpeerings"] == {"get", "list", "watch", "patch"}
        assert role["tetrad.dev/paralleltrainingjobs/status"] == {"patch"}
        assert objects[("RoleBinding", f"{ns}/tetrad")]["roleRef"]["kind"] == "Role"
        assert ("KopfPeering", f"{ns}/tetrad") in objects
    assert ("ClusterRole", "tetrad") not in objects and ("ClusterKopfPeering", "tetrad") not in objects
    # Node reads stay cluster-wide: the built-in gang needs every node's free capacity.
    cluster_rules = rules(objects[("ClusterRole", "tetrad-cluster")])
    assert cluster_rules == {"/nodes": {"get", "list", "watch"}, "/pods": {"list", "watch"}}


def test_one_replica_runs_standalone(k8s_tools):
    objects = render(k8s_tools, "replicas=1")
    assert "--standalone" in container(objects)["args"]
    assert not [k for k in objects if k[0] in ("ClusterKopfPeering", "PodDisruptionBudget")]


def test_settings_become_operator_environment(k8s_tools):
    objects = render(k8s_tools, "settings.RESYNC_SECONDS=5", "settings.API_CONCURRENCY=4", "image.tag=dev")
    env = {e["name"]: e["value"] for e in container(objects)["env"]}
    assert OperatorSettings.from_env(env).resync_seconds == 5.0
    assert OperatorSettings.from_env(env).api_concurrency == 4
    assert container(objects)["image"] == "tetrad/operator:dev"


def test_service_monitor(k8s_tools):
    monitor = render(k8s_tools, "metrics.serviceMonitor.enabled=true")[("ServiceMonitor", "tetrad")]
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "interval": "30s"}]
    proc = helm(k8s_tools, "template", "t", str(CHART), "--set", "metrics.serviceMonitor.enabled=true",
                "--set", "metrics.service.enabled=false")
    assert proc.returncode != 0
    assert "metrics.serviceMonitor.enabled needs metrics.service.enabled" in proc.stderr


@pytest.mark.parametrize(("setting", "message"), [
    ("replicas=0", "/replicas': minimum: got 0, want 1"),
    ("replica=2", "additional properties 'replica' not allowed"),
    ("watchNamespaces={Team_A}", "/watchNamespaces/0"),
    ("metrics.port=70000", "/metrics/port': maximum: got 70,000, want 65,535"),
    ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
    ("grafanaDashboard.enabled=yes", "/grafanaDashboard/enabled"),
    ("grafanaDashboard.namespace=Monitoring", "/grafanaDashboard/namespace"),
    ("metrics.podMonitor.interval=often", "/metrics/podMonitor/interval"),
    ("metrics.podMonitor.scrape=true", "additional properties 'scrape' not allowed"),
])
def test_the_values_schema_rejects_bad_values(k8s_tools, setting, message):
    proc = helm(k8s_tools, "template", "t", str(CHART), "--set", setting)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def dockerfile_stage(stage: str) -> dict[str, list[str]]:
    """The exec-form ENTRYPOINT and CMD of one Dockerfile stage."""
    found: dict[str, list[str]] = {}
    current = None
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.startswith("FROM "):
            current = line.split()[-1]
        elif current == stage and line.startswith(("ENTRYPOINT ", "CMD ")):
            key, _, value = line.partition(" ")
            found[key] = json.loads(value)
    return found


def test_the_images_run_what_the_chart_and_the_renderer_expect(k8s_tools):
    trainer = dockerfile_stage("trainer")
    builtin, _ = parse({"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob",
                        "metadata": {"name": "j"}})
    assert builtin is not None
    pods_command = node_command(resolve(builtin), python=PYTHON, launcher=INSTALLED_LAUNCHER,
                                config_path=CONFIG_PATH)
    assert trainer["ENTRYPOINT"] == [] and trainer["CMD"] == pods_command
    assert dockerfile_stage("operator")["ENTRYPOINT"] == container(render(k8s_tools))["command"]


def test_the_chart_ships_this_release():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]
