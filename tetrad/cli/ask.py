"""`tetrad checkpoint JOB` and `tetrad restart JOB`: what `kubectl annotate` with a new token does, and
then the operator's answer, read from the job's status.

`checkpoint_answer` and `restart_answer` are pure functions of the job object as the apiserver returns it
and the token asked: None while the operator has not answered.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tetrad.cli.cluster import Jobs
from tetrad.cli.status import ENDED

POLL_S = 1.0


@dataclass(frozen=True)
class Answer:
    done: bool  # False: refused, ignored, or the job ended first
    text: str


def new_token(now: datetime) -> str:
    """A token no earlier ask used: the time, and a random part for two asks in one second."""
    return f"{now.strftime('%Y%m%dT%H%M%SZ')}-{secrets.token_hex(3)}"


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _ended(job: dict[str, Any]) -> Answer | None:
    phase = _dict(job.get("status")).get("phase")
    return Answer(False, f"the job is {phase}: nothing to ask") if phase in ENDED else None


def checkpoint_answer(job: dict[str, Any], token: str) -> Answer | None:
    """Whether rank 0 served checkpoint-now `token` (the step it saved), or why it will not."""
    spec, status = _dict(job.get("spec")), _dict(job.get("status"))
    served = _dict(_dict(status.get("checkpoint")).get("requestCommitted"))
    if served.get("token") == token:
        return Answer(True, f"saved: rank 0 committed the checkpoint of step {served.get('step')}"
                            f" ({served.get('time')}); training goes on")
    if _dict(spec.get("checkpoint")).get("enabled") is False:
        return Answer(False, "ignored: checkpointing is off (spec.checkpoint.enabled=false)")
    return _ended(job)


def restart_answer(job: dict[str, Any], token: str) -> Answer | None:
    """Whether pod 0's coordinator took restart-in-place `token`, or why not."""
    status = _dict(job.get("status"))
    if status.get("restartRequested") != token:
        return _ended(job)
    asked, spec = _dict(status.get("inPlaceAsk")), _dict(job.get("spec"))
    if asked.get("token") != token:
        if spec.get("script") is None and _dict(spec.get("checkpoint")).get("enabled") is False:
            return Answer(False, "ignored: checkpointing is off (spec.checkpoint.enabled=false), so the"
                                 " restarted gang would begin again from step 0")
        return Answer(False, "the operator asked, but a later ask (a stall) took its place: see the job's"
                             " Events (kubectl describe ptj)")
    if asked.get("accepted") is True:
        round = asked.get("round")
        return Answer(True, "accepted: the gang restarts in its own pods"
                            + (f" (round {round + 1})" if isinstance(round, int) else "")
                            + "; every worker saves a checkpoint first, and the round spends no budget")
    if asked.get("accepted") is False:
        return Answer(False, "refused: pod 0's coordinator did not take it (a failure or another round under"
                             " way, a node not joined yet) or did not answer; nothing was restarted, ask"
                             " again")
    return None


@dataclass(frozen=True)
class Asked:
    token: str
    answer: Answer | None  # None: no answer within the wait


def ask(jobs: Jobs, name: str, annotation: str, answer: Callable[[dict[str, Any], str], Answer | None],
        wait_s: float, sleep: Callable[[float], None] = time.sleep) -> Asked:
    """Set `annotation` of job `name` to a new token, then read the job until `answer` says something or
    `wait_s` passed."""
    if (ended := _ended(jobs.get(name))) is not None:
        return Asked("", ended)
    token = new_token(datetime.now(UTC))
    jobs.annotate(name, annotation, token)
    give_up = time.monotonic() + wait_s
    while (said := answer(jobs.get(name), token)) is None and time.monotonic() < give_up:
        sleep(POLL_S)
    return Asked(token, said)
