"""status.checkpoint against a real API server: the operator scrapes a real Prometheus endpoint
standing in for rank 0 (TETRAD_OPERATOR_SCRAPE_HOST) that exports the trainer's checkpoint gauges
as the trainer does (NaN until set), across a preemption and the restart that resumes."""

from __future__ import annotations

import math
import time

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from tests.cluster_fixtures import table_row
from tetrad.api import contract

from .conftest import free_port, operator_in_thread
from .helpers import finish_all, ptj, terminate, wait_for, wait_phase, wait_running

pytestmark = pytest.mark.cluster


class Rank0:
    """A metrics endpoint with the checkpoint gauges of one trainer process at a time."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.gauges = {name: Gauge(name, "", registry=registry) for name in contract.SCRAPED_CHECKPOINT}
        self.new_process()
        self.port = free_port()
        self.server, _ = start_http_server(self.port, addr="127.0.0.1", registry=registry)

    def new_process(self) -> None:
        for g in self.gauges.values():
            g.set(math.nan)

    def set(self, name: str, value: float) -> None:
        self.gauges[name].set(value)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_status_checkpoint_survives_a_restart_and_says_where_it_resumed(api, operator_cluster, namespace):
    ns, rank0 = namespace, Rank0()

    def checkpoint() -> dict:
        return api.status(ns, "ck").get("checkpoint") or {}

    def last_ckpt_column() -> str:
        header, row = operator_cluster.kubectl("get", "ptj", "-n", ns, "ck").splitlines()[:2]
        return table_row(header, row)["LAST-CKPT"]

    try:
        with operator_in_thread([ns], env={"TETRAD_OPERATOR_SCRAPE_HOST": "127.0.0.1"}):
            api.create_job(ns, ptj("ck", nodes=2, metrics={"port": rank0.port},
                                   checkpoint={"enabled": True, "path": "/ckpt", "interval": 10}))
            wait_running(api, ns, "ck", 2)
            rank0.set(contract.METRIC_RESUMED_FROM, 0)  # a fresh start
            assert wait_for(checkpoint, what="status.checkpoint") == {"resumedFrom": 0, "resumedAtRestart": 0}
            assert last_ckpt_column() == ""

            committed = time.time()
            rank0.set(contract.METRIC_CHECKPOINT_STEP, 10)
            rank0.set(contract.METRIC_CHECKPOINT_TIME, committed)
            st = wait_for(lambda: checkpoint() if checkpoint().get("step") == 10 else None,
                          what="step 10 committed")
            assert st["path"] == "/ckpt/step-00000010" and st["time"].endswith("Z")
            assert last_ckpt_column() == "10"

            rank0.new_process()  # preempted: the next process starts with its gauges unset
            terminate(api, ns, "ck-r0-1", contract.EXIT_PREEMPTED)
            wait_running(api, ns, "ck", 2, restart=1)
            updated = api.status(ns, "ck").get("training", {}).get("updated")
            wait_for(lambda: api.status(ns, "ck").get("training", {}).get("updated") != updated,
                     what="a scrape of the new incarnation")
            assert checkpoint()["step"] == 10 and last_ckpt_column() == "10"  # not erased by the restart

            rank0.set(contract.METRIC_RESUMED_FROM, 10)
            st = wait_for(lambda: checkpoint() if checkpoint().get("resumedAtRestart") == 1 else None,
                          what="the restart's resume")
            assert st == {"step": 10, "time": st["time"], "path": "/ckpt/step-00000010", "resumedFrom": 10,
                          "resumedAtRestart": 1}
            finish_all(api, ns, "ck", 0)
            assert wait_phase(api, ns, "ck", "Succeeded")["checkpoint"]["step"] == 10
    finally:
        rank0.close()
