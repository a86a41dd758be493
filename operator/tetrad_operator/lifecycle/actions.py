"""What a decision asks of the cluster: idempotent actions, events, and the Decision that carries them.

Every action is safe to repeat: names are deterministic, creations are create-if-absent (or an
apply of the whole object), deletions are delete-if-present with a uid precondition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tetrad.api.spec import ParallelTrainingJobStatus
from tetrad_operator.packing import GangRequest


@dataclass(frozen=True)
class Ensure:
    """Bring this object (Service, ConfigMap, PodGroup) to exactly this content, creating it if absent."""

    obj: dict[str, Any]


@dataclass(frozen=True)
class CreatePod:
    obj: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])


@dataclass(frozen=True)
class DeletePod:
    name: str
    uid: str
    force: bool = False  # grace period 0: no kubelet will ever confirm the deletion


@dataclass(frozen=True)
class Ungate:
    """Remove the gang scheduling gate from these pods (name, uid)."""

    pods: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class DeleteStaleGang:
    """Delete the job's group objects of these kinds (apiVersion, kind), in this order, of every
    incarnation but `keep` (the schedulers that take a group per incarnation)."""

    keep: int
    kinds: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class AnnotatePod:
    """Merge these annotations into the pod (name, uid)."""

    name: str
    uid: str
    annotations: dict[str, str]


@dataclass(frozen=True)
class AskInPlace:
    """Ask pod 0's coordinator (pod `name`) to restart incarnation `restart`'s `round` in place, the
    workers saving a checkpoint first if `save` (a user's ask)."""

    name: str
    uid: str
    restart: int
    round: int
    why: str
    save: bool = False


@dataclass(frozen=True)
class DeleteJob:
    """The TTL after finishing ran out."""


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


Action = Ensure | CreatePod | DeletePod | Ungate | DeleteStaleGang | AnnotatePod | AskInPlace | DeleteJob


@dataclass
class Decision:
    status: ParallelTrainingJobStatus  # the next status, without the scraper's objects (see `merged`)
    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None  # reconcile again after this long even without events
    # The outcome rests on a pod being absent: confirm with a fresh list before acting, since a
    # watch cache can lag (e.g. right after a paused replica resumes).
    verify: bool = False
    gang: GangRequest | None = None  # a complete, gated gang asking the built-in admission to go
    # The whole new incarnation this pass creates (built-in gang): it may be created released if
    # the admission finds it fits now; otherwise its pods are created gated, as rendered.
    release_at_creation: GangRequest | None = None
    # What this pass learned of the status objects the scraper writes (status.SCRAPER_OWNED: training,
    # checkpoint), by object, as camelCase fields merge-patched into them (None removes one).
    merged: dict[str, dict[str, Any]] = field(default_factory=dict)
    # A judgment is due that rank 0's figures, read before it was, cannot make (a stall's deadline
    # passed since the last scrape): scrape now, not at the next scrape interval.
    read_now: bool = False

    def after(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)
