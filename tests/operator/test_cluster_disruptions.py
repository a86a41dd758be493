"""Disruptions against a real API server: their budget, and stall detection, where the operator
scrapes a real Prometheus endpoint standing in for rank 0 (TETRAD_OPERATOR_SCRAPE_HOST), whose
heartbeat gauge the test keeps beating, then stops, as a trainer hung in a collective would; and a
restart a user asks for in place."""

from __future__ import annotations

import re
import subprocess
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from tetrad.api import contract, parse
from tetrad.node import rounds
from tetrad.render.objects import rounds_gang

from .conftest import free_port, operator_in_thread
from .helpers import (
    JOBS,
    asked_token,
    condition,
    finish_all,
    ptj,
    terminate,
    tetrad_cli,
    wait_events,
    wait_for,
    wait_phase,
    wait_running,
)

pytestmark = pytest.mark.cluster

INTERVAL = 60  # the stall test's scrape interval (s)


def test_disruptions_over_the_budget_fail_the_job(api, operator, namespace):
    ns = namespace
    api.create_job(ns, ptj("spot", nodes=2, runPolicy={"maxDisruptions": 1, "backoffSeconds": 1}))
    wait_running(api, ns, "spot", 2)
    terminate(api, ns, "spot-r0-1", 75)  # preempted: within the budget
    wait_running(api, ns, "spot", 2, restart=1)
    terminate(api, ns, "spot-r1-0", 75)  # again: over it
    st = wait_phase(api, ns, "spot", "Failed")
    assert condition(st, "Failed")["reason"] == "DisruptionBudgetExceeded"
    assert ("spec.runPolicy.maxDisruptions=1" in st["message"]
            and "spot-r1-0 failed with exit code 75" in st["message"])
    assert (st["restarts"], st["disruptions"]) == (1, 1)
    assert wait_events(api, ns, "spot", "DisruptionBudgetExceeded")


class Rank0:
    """A metrics endpoint whose heartbeat beats while `beating` is set."""

    def __init__(self) -> None:
        registry = CollectorRegistry()
        self.heartbeat = Gauge(contract.METRIC_LAST_STEP_TIME, "", registry=registry)
        Gauge(contract.METRIC_STEP_TIME, "", registry=registry).set(0.2)
        self.port = free_port()
        self.server, _ = start_http_server(self.port, addr="127.0.0.1", registry=registry)
        self.beating, self.stopped = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        while not self.stopped.wait(0.2):
            if self.beating.is_set():
                self.heartbeat.set(time.time())

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.server.shutdown()
        self.server.server_close()


def test_a_gang_whose_heartbeat_stops_is_restarted_as_stalled_then_succeeds(api, operator_cluster, namespace):
    ns, rank0 = namespace, Rank0()
    try:
        # a scrape every 60 s, far above the timeout: the pass at the stall's deadline reads rank 0 at once
        with operator_in_thread([ns], env={"TETRAD_OPERATOR_SCRAPE_HOST": "127.0.0.1",
                                           "TETRAD_OPERATOR_SCRAPE_INTERVAL_SECONDS": str(INTERVAL)}):
            rank0.beating.set()
            api.create_job(ns, ptj("hang", nodes=2, metrics={"port": rank0.port},
                                   runPolicy={"stallTimeoutSeconds": 4, "backoffSeconds": 1}))
            wait_running(api, ns, "hang", 2)
            # the first pass while Running reads rank 0; a read slower than the 2 s scrape timeout (a
            # loaded machine) counts as unreachable, and the next comes one interval later
            wait_for(lambda: api.status(ns, "hang").get("training", {}).get("lastStepTime"),
                     timeout=2 * INTERVAL + 10, what="a heartbeat")
            time.sleep(8)  # twice the timeout with a steady heartbeat: nothing happens
            st = api.status(ns, "hang")
            assert (st["phase"], st["restarts"]) == ("Running", 0), st
            assert st["training"]["stepTimeSeconds"] == 0.2

            rank0.beating.clear()  # rank 0 hangs
            hung = time.monotonic()
            wait_for(lambda: api.status(ns, "hang").get("restarts") == 1, timeout=INTERVAL + 20,
                     what="the stalled gang restarted")
            waited = time.monotonic() - hung
            st = api.status(ns, "hang")
            assert st["disruptions"] == 1
            # first asked to restart in place: these pods have no coordinator, so the operator's ask is
            # refused at once and the gang is recreated
            (asked,) = wait_events(api, ns, "hang", "Stalled", "asked pod 0's coordinator")
            (recreated,) = wait_events(api, ns, "hang", "Stalled", "restarting the whole gang")
            # Judged from the first read after the deadline, not one a scrape interval later: the quiet
            # time the Event names (that read's time less the last beat's, whole seconds: up to 1 s more)
            # is the timeout, plus what a loaded machine adds to one pass and one read; an interval's
            # read would name about INTERVAL. The wall clock to the restart only has a floor here: on a
            # loaded machine (CI's two lanes) it once took 26.8 s where 4 to 8 s is usual.
            quiet = int(re.search(r"completed no step since \S+ for (\d+)s", asked["message"])[1])
            timeline = (f"restarted {waited:.1f}s after the hang; asked at {asked['firstTimestamp']}: "
                        f"{asked['message']!r}; recreated at {recreated['firstTimestamp']}; "
                        f"status.training {st['training']}, status.inPlaceAsk {st.get('inPlaceAsk')}")
            assert 4 <= quiet <= 4 + 1 + 10, timeline
            assert waited >= 4 - 1, timeline
            for event in (asked, recreated):
                assert event["type"] == "Warning", event
                assert "rank 0 (hang-r0-0) completed no step since" in event["message"]
                assert "(spec.runPolicy.stallTimeoutSeconds)" in event["message"]
            assert ("asked pod 0's coordinator to restart the gang in its own pods (round 1)"
                    in asked["message"])
            assert ("pod 0's coordinator did not restart it in place (it refused, or did not answer);"
                    " restarting the whole gang as restart 1") in recreated["message"]
            assert st["inPlaceAsk"]["accepted"] is False and st.get("restartsInPlace", 0) == 0

            rank0.beating.set()  # the new incarnation trains
            wait_running(api, ns, "hang", 2, restart=1)
            time.sleep(6)
            assert api.status(ns, "hang")["restarts"] == 1
            finish_all(api, ns, "hang", 0)
            st = wait_phase(api, ns, "hang", "Succeeded")
            assert (st["restarts"], st["disruptions"]) == (1, 1)
    finally:
        rank0.close()


def test_a_restart_asked_with_a_token_reaches_pod_0s_coordinator_saving_first(api, operator_cluster,
                                                                             namespace):
    """The tetrad.dev/restart-in-place annotation, through a real API server: the operator asks a real
    coordinator on loopback standing in for pod 0's (TETRAD_OPERATOR_SCRAPE_HOST), which aborts the round
    with its workers saving first; the ask, its token and its answer are kept in the status (the CRD's
    schema holds them); a second token, with nobody to take it, is told refused and recreates nothing.
    `tetrad restart` asks and reads the answer; a new token wakes the job's loop (no waiting for a resync).
    The second is asked only once no round can answer the first any more (3 s here, 120 by default)."""
    ns, port = namespace, free_port()
    path = f"{JOBS}/namespaces/{ns}/paralleltrainingjobs/asked"
    with operator_in_thread([ns], env={"TETRAD_OPERATOR_SCRAPE_HOST": "127.0.0.1",
                                       "TETRAD_OPERATOR_IN_PLACE_ASK_SECONDS": "3",
                                       "TETRAD_OPERATOR_RESYNC_SECONDS": "60",
                                       "TETRAD_OPERATOR_SCRAPE_INTERVAL_SECONDS": "60"}):
        api.create_job(ns, ptj("asked", nodes=2, rendezvous={"port": port - contract.ROUNDS_PORT_OFFSET},
                               checkpoint={"enabled": True, "path": "/ckpt"}))
        wait_running(api, ns, "asked", 2)
        job, _ = parse(api.job(ns, "asked"))
        assert job is not None
        served = rounds.Coordinator(rounds.Rounds(2, 0), rounds_gang(job, 0), "127.0.0.1", port)
        try:
            for node in (0, 1):
                served.rounds.join(node)
            began = time.monotonic()
            said = subprocess.run(tetrad_cli("restart", "asked", "-n", ns, "--wait", "30"),
                                  capture_output=True, text=True, timeout=60)
            took = time.monotonic() - began
        finally:
            served.close()
        assert said.returncode == 0, said.stderr
        assert took < 20, f"answered after {took:.0f} s: the token did not wake the job's loop"
        t1 = asked_token(said.stdout, contract.ANNOTATION_RESTART_IN_PLACE)
        assert "accepted: the gang restarts in its own pods (round 1)" in said.stdout
        asked = api.status(ns, "asked")
        assert asked["inPlaceAsk"]["token"] == t1 and asked["inPlaceAsk"]["accepted"] is True
        assert asked["restartRequested"] == t1
        assert served.rounds.cause is not None and served.rounds.save  # its workers save first
        (event,) = wait_events(api, ns, "asked", "RestartAsked")
        assert f"tetrad.dev/restart-in-place='{t1}': asked pod 0's coordinator" in event["message"]

        # kubectl annotate asks the same
        api.patch(path, {"metadata": {"annotations": {contract.ANNOTATION_RESTART_IN_PLACE: "t2"}}})
        (refused,) = wait_events(api, ns, "asked", "RestartNotInPlace")
        assert refused["type"] == "Warning" and "'t2'" in refused["message"]
        said = subprocess.run(tetrad_cli("restart", "asked", "-n", ns, "--wait", "30"),
                              capture_output=True, text=True, timeout=60)
        assert said.returncode == 1 and "refused: pod 0's coordinator did not take it" in said.stderr, said
        st = api.status(ns, "asked")
        assert (st["phase"], st["restarts"], st["inPlaceAsk"]["accepted"]) == ("Running", 0, False)
