"""Elastic jobs (spec.elastic): a gang that cannot get all of its pods runs on fewer, and grows back.

The gang admission counts the job's `room`: how many of its pods would fit in the cluster if its own
were gone (GangAdmitter.room); the controller passes it to `decide`. status.elastic.nodes is the size
of the current incarnation, rendered from the job resized to it (tetrad.plan.elastic).

- Shrink: the incarnation's pods have all existed for shrinkAfterSeconds, and not all run yet, and the
  room is short of them: the gang restarts on the largest size that fits and resolves (at least
  minNodes). Below minNodes it keeps waiting.
- Grow: the gang runs below spec.nodes and room for a larger size has lasted growAfterSeconds. Tetrad's
  trainer is asked for a checkpoint first (a checkpoint-now token on rank 0's pod, status.elastic.
  growRequest) and the gang restarts at the larger size once the scrape shows it committed; a script,
  which saves its own checkpoints, restarts at once. Without checkpoints the gang stays as it is.

A resize is a restart (phase Restarting, reason Shrunk or Grown: the goodput ledger cuts the incarnation
there) that spends no budget (status.elastic.resizes, subtracted like disruptions) and waits no backoff.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

from tetrad.api import contract
from tetrad.api.resolved import ResolvedConfig
from tetrad.api.spec import ElasticStatus, ParallelTrainingJob, ParallelTrainingJobStatus, Phase
from tetrad_operator.lifecycle import release
from tetrad_operator.lifecycle.actions import AnnotatePod
from tetrad_operator.lifecycle.machine import JobPass
from tetrad_operator.observed import PodState, format_time, parse_time

GROW_TOKEN = "grow-{restart}-{nodes}"  # the checkpoint-now token of a grow
RESIZES = ("Shrunk", "Grown")  # the reasons of a resize's Restarting, which waits no backoff
Sized = Callable[[int], ResolvedConfig | None]  # the job resolved at n pods, None where it cannot run


def size(status: ParallelTrainingJobStatus, job: ParallelTrainingJob) -> int:
    """The pods of the current incarnation."""
    return status.elastic.nodes if status.elastic is not None and job.spec.elastic else job.spec.nodes


def resizes(status: ParallelTrainingJobStatus) -> int:
    return status.elastic.resizes if status.elastic is not None else 0


def track(m: JobPass, job: ParallelTrainingJob, room: int | None) -> None:
    """status.elastic of an elastic job, with the room as last counted."""
    if job.spec.elastic is None:
        return
    e = m.status.elastic or ElasticStatus(nodes=job.spec.nodes)
    m.status.elastic = e.model_copy(update={"room": room if room is not None else e.room})


def largest(job: ParallelTrainingJob, sized: Sized, fits: int) -> int | None:
    """The largest size of at most `fits` pods (and spec.nodes) the job runs at, minNodes or more."""
    e = job.spec.elastic
    assert e is not None
    return next((n for n in range(min(fits, job.spec.nodes), e.min_nodes - 1, -1) if sized(n) is not None),
                None)


def shrink(m: JobPass, job: ParallelTrainingJob, sizes: Sized,
           pods: Sequence[PodState], restart: int, room: int | None) -> bool:
    """Restart a gang that waited shrinkAfterSeconds for room on as many pods as fit; True if it did."""
    e, e_status = job.spec.elastic, m.status.elastic
    if (e is None or e_status is None or room is None or room >= len(pods)
            or all(p.phase in ("Running", "Succeeded") for p in pods)):
        return False
    created = max((p.created for p in pods if p.created is not None), default=m.now)
    due = created + timedelta(seconds=e.shrink_after_seconds)
    if m.now < due:
        m.decision.after((due - m.now).total_seconds())
        return False
    smaller = largest(job, sizes, room)
    if smaller is None or smaller >= len(pods):
        return False
    _resize(m, pods, restart, smaller, "Shrunk",
            f"room for {room} of the gang's {len(pods)} pods after {e.shrink_after_seconds}s "
            f"(spec.elastic.shrinkAfterSeconds): restarting it on {smaller} of spec.nodes={job.spec.nodes}")
    return True


def grow(m: JobPass, job: ParallelTrainingJob, sizes: Sized,
         pods: Sequence[PodState], restart: int, room: int | None) -> bool:
    """A running gang below spec.nodes with room for more: ask for a checkpoint, then restart larger.
    True while a grow is under way (no other checkpoint-now request is forwarded meanwhile)."""
    e, e_status = job.spec.elastic, m.status.elastic
    if e is None or e_status is None or e_status.nodes >= job.spec.nodes:
        return False
    larger = largest(job, sizes, room) if room is not None else None
    if larger is None or larger <= e_status.nodes:
        if e_status.room_since or e_status.grow_request:
            m.status.elastic = e_status.model_copy(update={"room_since": None, "grow_request": None})
        return False
    since = parse_time(e_status.room_since) or m.now
    if e_status.room_since is None:
        m.status.elastic = e_status = e_status.model_copy(update={"room_since": format_time(m.now)})
    due = since + timedelta(seconds=e.grow_after_seconds)
    if m.now < due:
        m.decision.after((due - m.now).total_seconds())
        return False
    why = f"room for {larger} of spec.nodes={job.spec.nodes} pods for {e.grow_after_seconds}s"
    if job.spec.script is not None:
        _resize(m, pods, restart, larger, "Grown", f"{why}: restarting the gang on {larger} "
                "(the script resumes from its own checkpoint)")
        return True
    if not job.spec.checkpoint.enabled:
        return False  # growing would lose every step: the gang stays as it is
    token = GROW_TOKEN.format(restart=restart, nodes=larger)
    committed = m.checkpoint.request_committed
    if committed is not None and committed.token == e_status.grow_request:
        _resize(m, pods, restart, larger, "Grown", f"{why}: checkpoint step {committed.step} committed; "
                f"restarting the gang on {larger}")
        return True
    rank0 = pods[0]
    if e_status.grow_request != token:
        m.status.elastic = e_status.model_copy(update={"grow_request": token})
    if rank0.phase == "Running" and not rank0.deleting and rank0.checkpoint_request != token:
        m.decision.actions.append(AnnotatePod(rank0.name, rank0.uid,
                                              {contract.ANNOTATION_CHECKPOINT_NOW: token}))
    return True


def _resize(m: JobPass, pods: Sequence[PodState], restart: int, nodes: int, reason: str,
            message: str) -> None:
    e = m.status.elastic
    assert e is not None
    m.status.elastic = e.model_copy(update={"nodes": nodes, "resizes": e.resizes + 1, "room_since": None,
                                            "grow_request": None})
    m.status.restarts = restart + 1
    m.transition(Phase.RESTARTING, reason, f"{message} as restart {restart + 1}", warning=reason == "Shrunk")
    release.withdraw(m, reason, "the gang is resized")
    m.delete(pods)
