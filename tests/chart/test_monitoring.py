"""The chart's monitoring: the Grafana dashboard asks only for metrics that the trainer and the
operator really export (names taken from their code), and helm renders the dashboard ConfigMap
and the trainers' PodMonitor only when they are enabled. The PodMonitor keeps exactly the metrics
ports that the renderer gives a trainer pod."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tetrad_operator.operator_metrics import OperatorMetrics

from tests.chart.test_chart import CHART, helm, render
from tetrad.api import contract
from tetrad.api.spec import ParallelTrainingJob
from tetrad.render import render as render_job

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = CHART / "dashboards" / "tetrad.json"

# Sample names of each metric type in the exposition format.
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
            "histogram": ("_bucket", "_count", "_sum", "_created"),
            "summary": ("", "_count", "_sum", "_created"), "info": ("_info",)}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan"}


def operator_metrics() -> OperatorMetrics:
    return OperatorMetrics(lambda: {})


def operator_series() -> set[str]:
    return {family.name + suffix
            for family in operator_metrics().registry.collect() for suffix in SUFFIXES[family.type]}


def trainer_series() -> set[str]:
    return {*contract.TRAINER_GAUGES, *contract.STRAGGLER_GAUGES, contract.METRIC_INFO}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords and labels left out)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    e = re.sub(r"\{[^{}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # ranges and subqueries
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.:$])[A-Za-z_:][\w:]*", e):
        if m.group() in PROMQL_WORDS or e[m.end():].lstrip().startswith("("):
            continue  # a keyword, a function or an aggregation
        names.add(m.group())
    return names


def test_metric_names_finds_every_selector_and_nothing_else():
    expr = ('histogram_quantile(0.95, sum by (le) (rate(a_bucket{job=~"x|y"}[$__rate_interval]))) / '
            'on (pod) group_left (rank) b * 1e3 + count(c offset 5m) - sum(d) without (le) > bool 0')
    assert metric_names(expr) == {"a_bucket", "b", "c", "d"}
    assert metric_names('label_values(tetrad_step{namespace=~"$namespace"}, tetrad_job)') == {"tetrad_step",
                                                                                             "tetrad_job"}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in board["panels"]:
        yield p
        yield from p.get("panels", [])


def queries(board: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    for p in panels(board):
        for t in p.get("targets", []):
            yield f"panel {p['title']!r} {t['refId']}", t["expr"]
    for v in board["templating"]["list"]:
        if v["type"] == "query":
            # label_values(SELECTOR, LABEL): the selector is PromQL, the label is not a metric
            selector = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", v["query"]["query"])
            assert selector, v["query"]
            yield f"variable {v['name']!r}", selector.group(1)


def test_every_query_names_only_exported_metrics():
    exported = trainer_series() | operator_series()
    found = list(queries(dashboard()))
    assert len(found) > 20
    for where, expr in found:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        assert names <= exported, (f"{where}: {sorted(names - exported)} is exported by neither the trainer "
                                   f"nor the operator")


def test_the_dashboard_shows_what_a_person_watches():
    used = set().union(*(metric_names(e) for _, e in queries(dashboard())))
    trainer = {contract.METRIC_TOKENS_PER_SECOND, contract.METRIC_MFU, contract.METRIC_LOSS,
               contract.METRIC_STEP_TIME, contract.METRIC_PEAK_MEMORY, contract.METRIC_STEP,
               contract.METRIC_SLOWEST_RANK_LAG, contract.METRIC_RANK_LAG}
    assert trainer <= used
    m = operator_metrics()
    families = {name: metric.describe()[0] for name, metric in (
        ("reconcile latency", m.reconcile_duration), ("gang wait", m.gang_wait), ("API errors", m.api_errors),
        ("restarts and disruptions", m.restarts))}
    for what, family in families.items():
        assert {family.name + s for s in SUFFIXES[family.type]} & used, (
            f"no panel shows the operator's {what}")


def test_panels_are_laid_out_without_overlap():
    taken: set[tuple[int, int]] = set()
    ids = [p["id"] for p in panels(dashboard())]
    assert len(ids) == len(set(ids))
    for p in panels(dashboard()):
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"panel {p['title']!r} overlaps another"
        taken |= cells


@pytest.mark.cluster  # helm
def test_trainer_queries_use_labels_the_pod_monitor_sets(k8s_tools):
    monitor = render(k8s_tools, "metrics.podMonitor.enabled=true")[("PodMonitor", "tetrad-trainers")]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    relabeled = {r["targetLabel"] for r in endpoint["relabelings"] if "targetLabel" in r}
    # namespace and pod: every pod target has them; rank: a label of the trainer's tetrad_info.
    available = relabeled | {"namespace", "pod", "rank"}
    for where, expr in queries(dashboard()):
        if metric_names(expr) <= trainer_series():
            labels = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"", expr))
            labels |= {name.strip() for group in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr)
                       for name in group.split(",")}
            if "label_values" in expr or where.startswith("variable"):
                labels.add("tetrad_job")
            assert labels <= available, f"{where}: {sorted(labels - available)} is set by no relabeling"


@pytest.mark.cluster  # helm
def test_the_dashboard_configmap_only_when_enabled(k8s_tools):
    assert not [k for k in render(k8s_tools) if k[0] == "ConfigMap"]
    objects = render(k8s_tools, "grafanaDashboard.enabled=true",
                     "grafanaDashboard.annotations.grafana_folder=ML")
    cm = objects[("ConfigMap", "tetrad-dashboard")]
    assert cm["metadata"]["namespace"] == "tetrad-system"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "ML"}
    assert json.loads(cm["data"]["tetrad.json"]) == dashboard()
    other = render(k8s_tools, "grafanaDashboard.enabled=true", "grafanaDashboard.namespace=monitoring",
                   "grafanaDashboard.label=dashboards", "grafanaDashboard.labelValue=tetrad")
    cm = other[("ConfigMap", "tetrad-dashboard")]
    assert cm["metadata"]["namespace"] == "monitoring" and cm["metadata"]["labels"]["dashboards"] == "tetrad"


@pytest.mark.cluster  # helm
def test_lint_is_clean_with_every_monitor_on(k8s_tools):
    proc = helm(k8s_tools, "lint", "--strict", str(CHART), "--set", "grafanaDashboard.enabled=true",
                "--set", "metrics.podMonitor.enabled=true", "--set", "metrics.serviceMonitor.enabled=true")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.cluster  # helm
def test_pod_monitor_only_when_enabled_and_in_the_managed_namespaces(k8s_tools):
    assert not [k for k in render(k8s_tools) if k[0] == "PodMonitor"]
    everywhere = render(k8s_tools, "metrics.podMonitor.enabled=true")[("PodMonitor", "tetrad-trainers")]
    assert everywhere["spec"]["namespaceSelector"] == {"any": True}
    assert everywhere["spec"]["podMetricsEndpoints"][0]["interval"] == "15s"
    listed = render(k8s_tools, "metrics.podMonitor.enabled=true", "watchNamespaces={team-a,team-b}",
                    "metrics.podMonitor.labels.release=prom")[("PodMonitor", "tetrad-trainers")]
    assert listed["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert listed["metadata"]["labels"]["release"] == "prom"


def relabel(rules: list[dict[str, Any]], labels: dict[str, str]) -> dict[str, str] | None:
    """Prometheus relabeling (keep and replace, anchored regexes, ';' separator) of one target."""
    out = dict(labels)
    for r in rules:
        value = ";".join(out.get(s, "") for s in r["sourceLabels"])
        m = re.fullmatch(r.get("regex", "(.*)"), value)
        if r["action"] == "keep":
            if not m:
                return None
        elif r["action"] == "replace" and m:
            out[r["targetLabel"]] = m.expand(r.get("replacement", "$1").replace("$", "\\"))
    return out


@pytest.mark.cluster  # helm
def test_pod_monitor_scrapes_every_rank_of_a_rendered_pod(k8s_tools):
    """Each container port of a real rendered pod becomes a target the way Prometheus does it."""
    monitor = render(k8s_tools, "metrics.podMonitor.enabled=true")[("PodMonitor", "tetrad-trainers")]
    rules = monitor["spec"]["podMetricsEndpoints"][0]["relabelings"]
    selector = monitor["spec"]["selector"]
    job = ParallelTrainingJob.model_validate(
        yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text()))
    nproc = job.spec.nproc_per_node
    for rank, pod in enumerate(render_job(job, restart=3).pods):
        labels = pod["metadata"]["labels"]
        assert selector["matchLabels"].items() <= labels.items()
        assert all(e["key"] in labels for e in selector["matchExpressions"])
        (trainer,) = pod["spec"]["containers"]
        targets = []
        for port in trainer["ports"]:
            meta = {"__meta_kubernetes_pod_container_port_name": port["name"],
                    **{"__meta_kubernetes_pod_label_" + re.sub(r"[^\w]", "_", k): v
                       for k, v in labels.items()}}
            if (kept := relabel(rules, meta)) is not None:
                targets.append((port["containerPort"], kept))
        # not the rendezvous port
        assert [p for p, _ in targets] == [job.spec.metrics.port + i for i in range(nproc)]
        assert [(t["tetrad_job"], t["node_rank"], t["restart"], t["local_rank"]) for _, t in targets] == \
            [("quickstart", str(rank), "3", str(i)) for i in range(nproc)]

