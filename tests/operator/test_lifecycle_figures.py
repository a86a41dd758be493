"""The last figures rank 0 leaves in its termination message reach the job's status, driven through
the controller on the fake cluster: a job that ends between two scrapes shows its last step, loss and
checkpoint, not the last ones a scrape caught; a message without figures, or a cut one, changes nothing."""

from __future__ import annotations

import json

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from tetrad_operator.observed import format_time

from tetrad.api import contract

from .fakes import FakeCluster, job_body
from .test_lifecycle import running
from .test_lifecycle_checkpoint import CHECKPOINTED


def left_figures(step: int, loss: float, checkpoint_step: float = float("nan")) -> str:
    """Rank 0's termination message when it finished: its gauges as exposition text."""
    registry = CollectorRegistry()
    for name, value in ((contract.METRIC_STEP, step), (contract.METRIC_LOSS, loss),
                        (contract.METRIC_LAST_STEP_TIME, 1_900_000_100.0),
                        (contract.METRIC_CHECKPOINT_STEP, checkpoint_step),
                        (contract.METRIC_RESUMED_FROM, 0)):
        Gauge(name, "", registry=registry).set(value)
    return json.dumps({contract.TERMINATION_FIGURES: generate_latest(registry).decode()})


def scraped_at_step_18(c: FakeCluster) -> None:
    assert c.job is not None
    c.job["status"]["training"] = {"step": 18, "loss": 6.6, "updated": "2030-01-01T00:00:05Z"}


def test_a_finished_job_shows_the_last_step_and_loss_rank0_left():
    c = FakeCluster(job_body(nodes=2, **CHECKPOINTED))
    running(c)
    scraped_at_step_18(c)
    c.finish(0, rank=1)
    c.finish(0, rank=0, message=left_figures(20, 6.48, checkpoint_step=20))
    d = c.reconcile()
    assert c.phase == "Succeeded"
    assert d.merged["training"]["updated"] == format_time(c.now)  # when the operator read them
    assert {k: c.status["training"][k] for k in ("step", "loss", "lastStepTime")} == {
        "step": 20, "loss": 6.48, "lastStepTime": "2030-03-17T17:48:20Z"}
    assert c.status["checkpoint"] == {"step": 20, "path": "/ckpt/step-00000020", "resumedFrom": 0,
                                      "resumedAtRestart": 0}


def test_without_figures_the_last_scrape_stays():
    for message in (None, json.dumps({contract.TERMINATION_CHECKPOINT_STEP: 20}),
                    '{"figures": "tetrad_step 2'):
        c = FakeCluster(job_body(nodes=2))
        running(c)
        scraped_at_step_18(c)
        c.finish(0, message=message)
        d = c.reconcile()
        assert c.phase == "Succeeded" and "training" not in d.merged, message
        assert c.status["training"]["step"] == 18
