"""`decide`: the job's phases in order, composed from the restart policy (policy.py) and the
built-in gang (release.py) over one `JobPass` (machine.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from tetrad.api import InvalidJob, ParallelTrainingJob, ResolvedConfig, parse
from tetrad.api.spec import Phase, RunPolicy
from tetrad.plan import elastic as elastic_plan
from tetrad.render import gangs, render
from tetrad.render.objects import environment as render_environment
from tetrad.render.objects import pod as render_pod
from tetrad.resolve import resolve
from tetrad_operator.lifecycle import (
    checkpoint,
    closing,
    elastic,
    figures,
    in_place,
    policy,
    preflight,
    release,
    stragglers,
)
from tetrad_operator.lifecycle.actions import CreatePod, Decision, DeleteStaleGang, Ensure
from tetrad_operator.lifecycle.machine import TERMINAL, JobPass, Settings
from tetrad_operator.observed import NodeState, PodState, format_time, parse_time


@dataclass(frozen=True)
class ResolvedJob:
    """A job's spec, parsed and resolved; the same for every pass over one metadata.generation."""

    job: ParallelTrainingJob | None
    config: ResolvedConfig | None  # None: `problem` says why the spec cannot run
    problem: str = ""
    sized: dict[int, tuple[ParallelTrainingJob, ResolvedConfig] | None] = field(
        default_factory=dict, compare=False, repr=False)

    def at(self, nodes: int) -> tuple[ParallelTrainingJob, ResolvedConfig] | None:
        """The job resized to `nodes` pods (spec.elastic) and its config; None where it cannot run."""
        assert self.job is not None and self.config is not None
        if nodes == self.job.spec.nodes:
            return self.job, self.config
        if nodes not in self.sized:
            resized = elastic_plan.resized(self.job, self.config.layout, nodes)
            try:
                self.sized[nodes] = resized, resolve(resized)
            except InvalidJob:
                self.sized[nodes] = None
        return self.sized[nodes]

    def config_at(self, nodes: int) -> ResolvedConfig | None:
        sized = self.at(nodes)
        return sized[1] if sized is not None else None


def resolve_job(body: Mapping[str, Any]) -> ResolvedJob:
    doc = {k: body[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in body}
    job, problems = parse(doc)
    if job is None:
        return ResolvedJob(None, None, "; ".join(str(p) for p in problems))
    try:
        return ResolvedJob(job, resolve(job))
    except InvalidJob as e:
        return ResolvedJob(job, None, str(e))


@dataclass(frozen=True)
class PodRejection:
    """The API server refused to create the job's pods (a quota, an admission webhook, an invalid
    field) in `attempts` passes in a row; `message` is its last answer."""

    attempts: int
    message: str


def decide(body: Mapping[str, Any], pods: Sequence[PodState], nodes: Mapping[str, NodeState], now: datetime,
           settings: Settings | None = None, *, spec: ResolvedJob | None = None,
           rejection: PodRejection | None = None, queued: str | None = None,
           room: int | None = None) -> Decision:
    """The next status and the actions that move the cluster toward it.

    `pods` are the job's pods (any restart), `nodes` every node by name. `spec` is
    `resolve_job(body)`, which a caller may keep per generation (it is computed when absent).
    `queued` is the scheduler's reason for holding the job's pods (its backend's `queued_reason`).
    `room`: how many of the job's pods fit in the cluster if its own were gone (an elastic job's).
    """
    m = JobPass(body, pods, nodes, now, settings or Settings())
    _phases(m, spec or resolve_job(body), rejection, queued, room)
    return m.decided()


def _phases(m: JobPass, spec: ResolvedJob, rejection: PodRejection | None, queued: str | None,
            room: int | None) -> None:
    job, cfg, now = spec.job, spec.config, m.now
    if job is None or cfg is None:
        if m.phase not in TERMINAL:
            m.transition(Phase.FAILED, "InvalidSpec", f"the spec is invalid: {spec.problem}", warning=True)
            m.status.completion_time = format_time(now)
        m.finished(job.spec.run_policy if job is not None else RunPolicy())
        return

    elastic.track(m, job, room)
    job, cfg = spec.at(elastic.size(m.status, job)) or (job, cfg)  # an elastic job at its current size
    m.status.world_size = cfg.world_size
    m.status.mesh = cfg.layout.label()
    run_policy = job.spec.run_policy
    if m.phase in TERMINAL:
        m.finished(run_policy)
        if m.phase == Phase.FAILED:
            m.decision.actions.extend(closing.close_group(job.spec, m.pods))
        return
    if run_policy.suspend or (m.phase == Phase.SUSPENDED and m.pods):  # a resume waits for the suspend's pods
        checkpoint.suspend(m, job)
        return
    if m.phase == Phase.SUSPENDED:
        checkpoint.resumed(m, job)
    if not m.phase:
        m.transition(Phase.PENDING, "Created", "creating the job's objects")
    if m.status.start_time is None:
        m.status.start_time = format_time(now)

    deadline = run_policy.active_deadline_seconds
    if deadline is not None:
        start = parse_time(m.status.start_time) or now
        left = deadline - (now - start).total_seconds()
        if left <= 0:
            m.fail("DeadlineExceeded", f"the job was active longer than activeDeadlineSeconds={deadline}",
                   run_policy)
            return
        m.decision.after(left)

    if rejection is not None and rejection.attempts >= m.settings.pod_create_attempts:
        m.fail("PodCreationRejected",
               f"the API server rejected the job's pods {rejection.attempts} times in a row: "
               f"{rejection.message}", run_policy)
        return

    _active(m, job, cfg, queued, spec, room)


def _active(m: JobPass, job: ParallelTrainingJob, cfg: ResolvedConfig, queued: str | None,
            resolved: ResolvedJob, room: int | None) -> None:
    """`job` and `cfg` at the current incarnation's size; `resolved` is the job as asked for."""
    spec, run_policy = job.spec, job.spec.run_policy
    recorded = m.status.restarts
    restart = max([recorded, *(p.restart for p in m.pods)])
    if restart > recorded and m.phase == Phase.RUNNING:
        m.transition(Phase.RESTARTING, "Recovered", f"found pods of restart {restart}; continuing with it")
    m.status.restarts = restart
    old = [p for p in m.pods if p.restart < restart]
    current = {p.rank: p for p in m.pods if p.restart == restart and 0 <= p.rank < spec.nodes}
    backend = gangs.backend(spec)
    gated = backend.operator_admits  # Tetrad's own gates and admission (the built-in gang)
    gang_timed_out = gated and release.timed_out(m)
    expect_deleting = gang_timed_out or m.phase == Phase.PENDING  # our own re-creation after suspend/timeout
    in_place.observe(m, restart, current.values(), run_policy)  # its restarts in place so far

    # 1. Any failure in the current gang: fail the job, or restart the whole gang.
    failures = policy.failures(m, current, spec.nodes, expect_deleting)
    if failures:
        # what rank 0 left if it already stopped (a preemption's save): the goodput's last account
        figures.record_left(m, job, current.get(0))
        preflight.record(m, [n for f in failures for n in f.nodes], restart, spec.preflight)
        stragglers.exclude_sustained(m, restart, spec)
        policy.on_failure(m, failures, list(current.values()), restart, run_policy)
        return

    # 2. Pods of earlier incarnations must be gone before a new one starts. A finished pod held by a
    #    finalizer is gone in all that matters (Kueue holds its pod group's until new pods replace them).
    if old:
        m.delete(old)
        if any(not (p.terminal and p.deleting) for p in old):
            return

    # 3. Create the incarnation's missing pods, after the restart backoff.
    missing = [r for r in range(spec.nodes) if r not in current]
    if missing:
        if any(p.deleting for p in current.values()):
            m.delete([p for p in current.values() if p.deleting])  # force them when stuck
            return
        hold = policy.hold_until(m, run_policy, restart, gang_timed_out)
        if hold is not None and hold > m.now:
            m.decision.after((hold - m.now).total_seconds())
            return
        if m.phase == Phase.RESTARTING:
            m.transition(Phase.PENDING, "Restarted", f"creating the pods of restart {restart}")
        new: list[dict[str, Any]] = []
        if not current:  # a new incarnation: its Service, ConfigMaps and PodGroup, then every pod
            in_place.next_incarnation(m)
            rendered = render(job, restart=restart, config=cfg, excluded_nodes=preflight.excluded(m.status),
                              in_place_left=in_place.left(m.status, run_policy))
            m.decision.actions.extend(Ensure(o) for o in (rendered.service, rendered.configmap,
                                                            rendered.environment, *rendered.gang_objects()))
            if backend.group_per_incarnation and restart > 0:  # a PodGroup before its Workload
                kinds = tuple((o["apiVersion"], o["kind"]) for o in reversed(rendered.gang_objects()))
                m.decision.actions.append(DeleteStaleGang(keep=restart, kinds=kinds))
            m.decision.actions.extend(CreatePod(p) for p in rendered.pods)
            new = rendered.pods
        else:  # only the missing pods (rendering a 1024-pod gang takes a while)
            # An operator older than the environment ConfigMap may have begun this incarnation.
            m.decision.actions.append(Ensure(render_environment(job, cfg)))
            avoid = preflight.excluded(m.status)
            left = in_place.left(m.status, run_policy)
            m.decision.actions.extend(CreatePod(render_pod(job, cfg, rank=r, restart=restart,
                                                           excluded_nodes=avoid, in_place_left=left))
                                      for r in missing)
        if gated:
            release.creating(m, spec.nodes, restart, new)
        return

    pods = [current[r] for r in range(spec.nodes)]
    # 4. Every pod finished: success.
    if all(p.phase == "Succeeded" for p in pods):
        figures.record_left(m, job, pods[0])  # the last step and loss, which no scrape may have caught
        m.transition(Phase.SUCCEEDED, "Succeeded", f"all {spec.nodes} pods succeeded")
        m.status.completion_time = format_time(m.now)
        m.finished(run_policy)
        return

    # 5. An elastic gang that waited too long for room restarts on fewer pods.
    assert resolved.job is not None
    if elastic.shrink(m, resolved.job, resolved.config_at, pods, restart, room):
        return

    # 6. The built-in gang: admission, release of the remaining gates, and the gang timeout.
    if gated and release.drive(m, job, pods, restart):
        return

    # 7. Running once every pod runs (or already succeeded); GangWaiting before.
    if all(p.phase in ("Running", "Succeeded") for p in pods):
        preflight.report_slow(m, restart, spec.preflight.slow_node_fraction)  # the SlowNodes condition
        stragglers.report(m, restart, spec.metrics.slow_rank_lag)  # the SlowRank condition
        if m.phase != Phase.RUNNING:
            m.transition(Phase.RUNNING, "AllPodsRunning", f"all {spec.nodes} pods are running")
        elif (pods[0].phase == "Running"
                and (stall := policy.stalled(m, run_policy, pods[0], policy.steps_of(spec))) is not None):
            # 8. a hung gang: restarted in place if pod 0's coordinator takes it, else a disruption
            if not in_place.ask_for(m, stall.detail, pods[0], restart, run_policy):
                stall = replace(stall, detail=stall.detail + in_place.not_in_place(m, restart))
                policy.on_failure(m, [stall], pods, restart, run_policy)
        elif not elastic.grow(m, resolved.job, resolved.config_at, pods, restart, room):  # 9. room for more
            checkpoint.forward_request(m, job, pods[0])  # 10. a checkpoint-now token, to rank 0
            in_place.restart_asked(m, job, pods[0], restart)  # 11. a restart-in-place token, to pod 0
    else:  # the queue's or the scheduler's reason, as it changes
        scheduler = spec.gang.scheduler.value
        if queued:
            reason, message = "WaitingForQueue", (f"all {spec.nodes} pods exist; {scheduler} has not "
                                                  f"admitted them: {queued}")
        else:
            why = next((f": {p.unschedulable}" for p in pods if p.unschedulable), "")
            reason, message = "WaitingForScheduler", (f"all {spec.nodes} pods exist; waiting for "
                                                      f"{scheduler} to place and start them{why}")
        if m.phase != Phase.GANG_WAITING or (not gated and m.status.message != message):
            m.transition(Phase.GANG_WAITING, reason, message)
