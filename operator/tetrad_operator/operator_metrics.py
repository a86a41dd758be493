"""The operator's own Prometheus metrics, served on --metrics-port.

Each operator instance owns a registry, so two instances in one process (tests) do not mix.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tetrad.api.spec import GoodputStatus, Phase


class _JobsByPhase(Collector):
    def __init__(self, phases: Callable[[], Mapping[Any, str]]):
        self.phases = phases

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily("tetrad_operator_jobs",
                              "ParallelTrainingJobs handled by this operator, by phase.", labels=["phase"])
        counts = Tally(self.phases().values())
        for phase in Phase:
            g.add_metric([phase.value], counts.get(phase.value, 0))
        yield g


class _JobsGoodput(Collector):
    """Each job's status.goodput, as its loop last wrote it (a job's series go with its loop). The job's
    labels are not `namespace` and `job`, which Prometheus gives the operator's own target."""

    def __init__(self, goodput: Callable[[], Mapping[tuple[str, str], GoodputStatus | None]]):
        self.goodput = goodput

    def collect(self) -> Iterator[GaugeMetricFamily]:
        share = GaugeMetricFamily(GOODPUT, "The share of the job's wall time spent on steps that counted "
                                  "(status.goodput.fraction).", labels=["job_namespace", "tetrad_job"])
        spent = GaugeMetricFamily(GOODPUT_SECONDS, "The job's wall time by kind: productive and each kind of "
                                  "lost time (status.goodput.seconds).",
                                  labels=["job_namespace", "tetrad_job", "kind"])
        for (namespace, job), g in sorted(self.goodput().items()):
            if g is None or g.fraction is None:
                continue
            share.add_metric([namespace, job], g.fraction)
            for kind, seconds in g.seconds.model_dump().items():
                spent.add_metric([namespace, job, kind], seconds)
        yield share
        yield spent


GOODPUT = "tetrad_job_goodput"
GOODPUT_SECONDS = "tetrad_job_wall_seconds"


class OperatorMetrics:
    def __init__(self, phases: Callable[[], Mapping[Any, str]],
                 goodput: Callable[[], Mapping[tuple[str, str], GoodputStatus | None]] = dict):
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_JobsByPhase(phases))
        r.register(_JobsGoodput(goodput))
        self.jobs_created = Counter("tetrad_operator_jobs_created", "Jobs seen for the first time.",
                                    registry=r)
        self.jobs_succeeded = Counter("tetrad_operator_jobs_succeeded", "Jobs that succeeded.", registry=r)
        self.jobs_failed = Counter("tetrad_operator_jobs_failed", "Jobs that failed, by reason.", ["reason"],
                                   registry=r)
        self.restarts = Counter("tetrad_operator_gang_restarts", "Whole-gang restarts, by reason.",
                                ["reason"], registry=r)
        self.pods_created = Counter("tetrad_operator_pods_created", "Pods created.", registry=r)
        self.pods_deleted = Counter("tetrad_operator_pods_deleted", "Pod deletions requested.", ["force"],
                                    registry=r)
        self.gangs_admitted = Counter("tetrad_operator_gangs_admitted", "Built-in gangs released.",
                                      registry=r)
        self.gang_wait = Histogram(
            "tetrad_operator_gang_wait_seconds",
            "Time a complete built-in gang waited for capacity before release.",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600), registry=r)
        self.reconcile_duration = Histogram(
            "tetrad_operator_reconcile_duration_seconds",
            "Duration of one job reconcile (read, decide, write).",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        self.reconcile_errors = Counter("tetrad_operator_reconcile_errors", "Reconciles that raised.",
                                        registry=r)
        self.api_errors = Counter("tetrad_operator_api_errors",
                                  "Failed Kubernetes API calls, by verb and HTTP status "
                                  "(0: connection error).", ["verb", "code"], registry=r)
        self.scrapes = Counter("tetrad_operator_scrapes", "Reads of rank 0's metrics endpoint, by result.",
                               ["result"], registry=r)

    def api_error(self, verb: str, status: int) -> None:
        self.api_errors.labels(verb, str(status)).inc()

    def serve(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Start the HTTP endpoint in a thread; returns the server (call .shutdown() to stop)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server
