"""Deterministic names: every object's name follows from (job name, restart count, rank)."""

from __future__ import annotations

from tetrad.api.contract import LABEL_JOB, LABEL_MANAGED_BY, MANAGED_BY


def pod_selector(job: str | None = None) -> str:
    """Label selector of the pods Tetrad manages: one job's, or every job's."""
    return f"{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_JOB}" + (f"={job}" if job else "")


def service(job: str) -> str:
    """Headless Service; also the pods' DNS subdomain."""
    return job


def configmap(job: str) -> str:
    return f"{job}-config"


def environment(job: str) -> str:
    """The ConfigMap of the environment every pod of the job shares."""
    return f"{job}-env"


def pod_group(job: str) -> str:
    return job


def incarnation(job: str, restart: int) -> str:
    """The PodGroup (and Workload) of one incarnation, for the schedulers that take each restart's
    gang as a new group: pods name their group immutably, and the old gang may still be terminating."""
    return f"{job}-r{restart}"


def hostname(job: str, rank: int) -> str:
    """Stable across restarts, so the master's DNS name never changes."""
    return f"{job}-{rank}"


def pod(job: str, restart: int, rank: int) -> str:
    """Unique per restart, so a new gang never collides with the old one terminating."""
    return f"{job}-r{restart}-{rank}"


def master_addr(job: str, namespace: str) -> str:
    return f"{hostname(job, 0)}.{service(job)}.{namespace}.svc"


def rendezvous_id(job: str, uid: str | None, restart: int) -> str:
    """A new id per restart: torchrun agents of an old gang can never join the new one."""
    return f"{job}-{(uid or 'local')[:8]}-{restart}"
