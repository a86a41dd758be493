"""The operator process: validation at apply, bad specs, live figures, metrics, peering, RBAC."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from .conftest import REPO, free_port, operator_in_thread, operator_process
from .helpers import condition, finish_all, ptj, wait_events, wait_for, wait_phase, wait_running

pytestmark = pytest.mark.cluster


def test_the_api_server_rejects_bad_specs_with_the_cel_messages(operator_cluster, namespace):
    bad = ptj("bad", nodes=2, parallelism={"dpShard": 2, "tp": 2})
    proc = operator_cluster.run_kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(bad))
    assert proc.returncode != 0
    assert ("the product of the degrees dpReplicate*dpShard*tp*cp*pp = 1*2*2*1*1 = 4 "
            "must equal nodes*nprocPerNode = 2*1 = 2") in proc.stderr
    bad = ptj("bad", nodes=2, gang={"scheduler": "kueue"})
    proc = operator_cluster.run_kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(bad))
    assert proc.returncode != 0 and "gang.scheduler=kueue needs gang.queue" in proc.stderr
    bad = ptj("bad", nodes=0)
    proc = operator_cluster.run_kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(bad))
    assert proc.returncode != 0 and "spec.nodes" in proc.stderr


def test_a_spec_failing_deeper_checks_is_failed_and_the_operator_carries_on(api, operator, namespace):
    ns = namespace
    # CEL cannot see this: the batch does not split over dpShard=2 (Python validation does).
    api.create_job(ns, ptj("odd-batch", nodes=2, parallelism={"dpShard": 2}, training={"globalBatch": 3}))
    st = wait_phase(api, ns, "odd-batch", "Failed")
    assert condition(st, "Failed")["reason"] == "InvalidSpec"
    assert "spec.training.globalBatch" in st["message"]
    assert not api.pods(ns, "odd-batch")
    assert wait_events(api, ns, "odd-batch", "InvalidSpec")
    api.create_job(ns, ptj("fine", nodes=1))
    wait_running(api, ns, "fine", 1)
    assert operator.thread.is_alive() and not operator.errors


def test_live_training_figures_from_rank_0(api, operator_cluster, namespace):
    registry = CollectorRegistry()
    gauges = {n: Gauge(n, n, registry=registry) for n in
              ("tetrad_step", "tetrad_loss", "tetrad_tokens_per_second", "tetrad_mfu",
               "tetrad_peak_memory_bytes")}
    gauges["tetrad_step"].set(42)
    gauges["tetrad_loss"].set(3.25)
    gauges["tetrad_tokens_per_second"].set(12345.5)
    gauges["tetrad_mfu"].set(0.41)
    gauges["tetrad_peak_memory_bytes"].set(2**33)
    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        with operator_in_thread([namespace], env={"TETRAD_OPERATOR_SCRAPE_HOST": "127.0.0.1"}):
            api.create_job(namespace, ptj("live", nodes=2, metrics={"port": port}))
            wait_running(api, namespace, "live", 2)
            t = wait_for(lambda: api.status(namespace, "live").get("training"), what="training figures")
            assert t["step"] == 42 and t["loss"] == 3.25 and t["tokensPerSecond"] == 12345.5
            assert t["mfu"] == 0.41 and t["peakMemoryBytes"] == 2**33 and t["updated"]
            gauges["tetrad_step"].set(43)
            wait_for(lambda: api.status(namespace, "live")["training"]["step"] == 43,
                     what="figures refreshed")
            # An unreachable endpoint never blocks the job.
            server.shutdown()
            finish_all(api, namespace, "live", 0)
            wait_phase(api, namespace, "live", "Succeeded")
    finally:
        server.server_close()


def test_operator_metrics(api, operator, namespace):
    api.create_job(namespace, ptj("counted", nodes=2))
    wait_running(api, namespace, "counted", 2)
    finish_all(api, namespace, "counted", 0)
    wait_phase(api, namespace, "counted", "Succeeded")

    def metrics() -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics",
                                      timeout=5).read().decode()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    m = wait_for(lambda: (lambda m: m if m.get('tetrad_operator_jobs{phase="Succeeded"}') == 1 else None)(
        metrics()), what="jobs gauge")
    assert m["tetrad_operator_jobs_created_total"] == 1
    assert m["tetrad_operator_jobs_succeeded_total"] == 1
    assert m["tetrad_operator_pods_created_total"] == 2
    assert m["tetrad_operator_gangs_admitted_total"] == 1
    assert m["tetrad_operator_gang_wait_seconds_count"] == 1
    assert m["tetrad_operator_reconcile_duration_seconds_count"] >= 3
    assert 'tetrad_operator_jobs{phase="Running"}' in m


def test_two_replicas_with_peering_run_one_at_a_time(api, operator_cluster, namespace):
    ns = namespace
    api.create(f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings",
               {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "tetrad"}})
    peering = f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings/tetrad"
    # With --peering kopf starts paused and runs only once no live peer has a higher priority.
    with operator_in_thread([ns], peering="tetrad", priority=200) as high, \
            operator_in_thread([ns], peering="tetrad", priority=100) as low:
        wait_for(lambda: len((api.get(peering) or {}).get("status") or {}) == 2,
                 what="both replicas in the peering")
        time.sleep(2)  # let the low one see the high one
        _run_peered(api, ns, peering, high, low)
    assert len(api.pods(ns, "peered")) == 2


def _run_peered(api, ns, peering, high, low) -> None:
    api.create_job(ns, ptj("peered", nodes=2))
    wait_running(api, ns, "peered", 2)
    wait_for(lambda: high.controller.phases.get((ns, "peered")) == "Running",
             what="the active replica's view")
    assert (ns, "peered") not in low.controller.phases, "the paused replica must not reconcile"
    # The high one leaves the peering; the low one resumes with an index that missed everything
    # created while it was paused.
    high.shutdown()
    finish_all(api, ns, "peered", 0)
    try:
        wait_phase(api, ns, "peered", "Succeeded", timeout=60)
    except TimeoutError as e:
        events = [(ev["reason"], ev["message"]) for ev in api.events(ns, "peered")]
        raise AssertionError(f"{e}; peering: {api.get(peering)['status']}; low sees {low.controller.phases}; "
                             f"events {events}") from None
    assert low.controller.phases.get((ns, "peered")) == "Succeeded"
    # No replica mistook the hand-over for a failure.
    assert api.status(ns, "peered")["restarts"] == 0


def test_the_chart_installs_and_its_least_privilege_rbac_is_enough(
        api, operator_cluster, namespace, tmp_path):
    """helm installs the chart for one namespace into the real apiserver; the operator, run with its
    ServiceAccount's token and the chart's KopfPeering, takes a job to Succeeded without a 403."""
    cluster, ns = operator_cluster, namespace
    release = f"tetrad-{ns[-6:]}"  # cluster-scoped roles are named after it: unique per test
    helm = [str(cluster.bin_dir / "helm"), "--kubeconfig", str(cluster.kubeconfig), "-n", ns]
    subprocess.run([*helm, "install", release, str(REPO / "charts" / "tetrad"), "--skip-crds", "--wait",
                    "--timeout", "120s", "--set", f"watchNamespaces={{{ns}}}"],
                   check=True, capture_output=True)
    try:
        deployment = api.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{release}")
        assert deployment["status"]["availableReplicas"] == 2  # on kwok nodes, spread by anti-affinity
        assert api.get(f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings/tetrad") is not None
        _operator_runs_with_the_chart_rbac(api, cluster, ns, release, tmp_path)
        _without_the_cluster_wide_pods_watch(api, cluster, ns, release, tmp_path)
    finally:
        subprocess.run([*helm, "uninstall", release, "--wait"], check=True, capture_output=True)
    assert api.get(f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{release}-cluster") is None


def _operator_runs_with_the_chart_rbac(api, cluster, ns, release, tmp_path) -> None:
    sa = f"system:serviceaccount:{ns}:{release}"
    for verb, resource, where in (("get", "secrets", ns), ("list", "secrets", ns), ("delete", "nodes", ns),
                                  ("create", "clusterroles", ns),
                                  ("update", "paralleltrainingjobs.tetrad.dev", ns),
                                  ("delete", "services", ns), ("create", "pods", "default"),
                                  ("patch", "clusterkopfpeerings.kopf.dev", ns)):
        assert cluster.run_kubectl("auth", "can-i", verb, resource, "-n", where, "--as",
                                   sa).stdout.strip() == "no", (verb, resource, where)
    for verb, resource in (("create", "pods"), ("patch", "paralleltrainingjobs.tetrad.dev/status"),
                           ("list", "nodes"), ("patch", "kopfpeerings.kopf.dev")):
        assert cluster.run_kubectl("auth", "can-i", verb, resource, "-n", ns, "--as",
                                   sa).stdout.strip() == "yes", (verb, resource)

    text = _a_job_succeeds(api, ns, _service_account_kubeconfig(cluster, ns, release, tmp_path), "rbac",
                           tmp_path / "operator.log")
    # 403 as a number of its own: the log's random peering priority may hold the digits (1964037304).
    assert not re.search(r"\b403\b", text) and "Forbidden" not in text, text[-3000:]
    assert "may not list and watch pods in every namespace" not in text


def _without_the_cluster_wide_pods_watch(api, cluster, ns, release, tmp_path) -> None:
    """An old or hand-made ClusterRole with pods [list] only: the gang admission watches the job
    namespaces instead (the namespaced Role has the watch) and says so; without the watch there
    too the operator stops at start-up, naming the rule, instead of listing every 10 s."""
    cluster_role = f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{release}-cluster"
    rules = api.get(cluster_role)["rules"]
    pods = next(r for r in rules if r["resources"] == ["pods"])
    pods["verbs"] = ["list"]
    api.patch(cluster_role, {"rules": rules})
    kubeconfig = _service_account_kubeconfig(cluster, ns, release, tmp_path)
    sa = f"system:serviceaccount:{ns}:{release}"
    wait_for(lambda: cluster.run_kubectl("auth", "can-i", "watch", "pods", "-A", "--as",
                                         sa).stdout.strip() == "no",
             what="the cluster-wide pods watch revoked")
    text = _a_job_succeeds(api, ns, kubeconfig, "namespaced", tmp_path / "operator-namespaced.log")
    assert ("may not list and watch pods in every namespace: the gang admission counts only the pods of "
            + ns in text)

    role = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles/{release}"
    rules = api.get(role)["rules"]
    for rule in rules:
        if rule["resources"] == ["pods"]:
            rule["verbs"] = [v for v in rule["verbs"] if v != "watch"]
    api.patch(role, {"rules": rules})
    wait_for(lambda: cluster.run_kubectl("auth", "can-i", "watch", "pods", "-n", ns, "--as",
                                         sa).stdout.strip() == "no",
             what="the namespaced pods watch revoked")
    log = tmp_path / "operator-refused.log"
    proc = operator_process(ns, kubeconfig=kubeconfig, log=log, peering="tetrad")
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"the operator kept running without the pods watch: "
                             f"{log.read_text()[-3000:]}") from None
    text = log.read_text()
    assert code == 1 and (f"stopped at start-up: the gang admission must list and watch pods in {ns}"
                          in text), (code, text[-3000:])
    assert "Traceback" not in text and "Unclosed" not in text, text[-3000:]


def _a_job_succeeds(api, ns, kubeconfig, name, log) -> str:
    """An operator process with this kubeconfig takes a 2-pod job to Succeeded and keeps running;
    its log."""
    proc = operator_process(ns, kubeconfig=kubeconfig, log=log, peering="tetrad")
    try:
        api.create_job(ns, ptj(name, nodes=2))
        wait_running(api, ns, name, 2, timeout=60)
        finish_all(api, ns, name, 0)
        wait_phase(api, ns, name, "Succeeded")
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(30)
    return log.read_text()


def _service_account_kubeconfig(cluster, ns, release, tmp_path) -> Path:
    """A kubeconfig for the release's ServiceAccount, through a fresh token."""
    token = cluster.kubectl("create", "token", release, "-n", ns, "--duration", "1h").strip()
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    server = admin["clusters"][0]["cluster"]
    ca = server.get("certificate-authority-data") or base64.b64encode(
        Path(server["certificate-authority"]).read_bytes()).decode()
    kubeconfig = tmp_path / "operator.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "op",
        "clusters": [{"name": "c",
                      "cluster": {"server": server["server"], "certificate-authority-data": ca}}],
        "users": [{"name": "op", "user": {"token": token}}],
        "contexts": [{"name": "op", "context": {"cluster": "c", "user": "op"}}],
    }))
    return kubeconfig
