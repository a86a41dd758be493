"""Built-in gang admission: release a gang only when all of its pods fit at once.

Pure functions over observed nodes and pods. The fit is a first-fit-decreasing bin packing
of the gang's pods onto the free allocatable resources of schedulable nodes, honouring
taints/tolerations, nodeSelector, required node affinity and the gang's own co-location (pods
that require each other in one domain of a node label, e.g. a pipeline stage in one rack), after
subtracting the pods already bound and the gangs already released but not yet bound.

Only the built-in gang backend (tetrad.render.gangs.builtin) is admitted here; the other
schedulers enforce the gang themselves, from the objects and pod fields their backends render.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from tetrad_operator.observed import NodeState, PodState
from tetrad_operator.resources import Resources

BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")
NO_ROOM = Resources()


def tolerates(tolerations: Iterable[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        op = t.get("operator") or "Equal"
        if not t.get("key"):
            if op == "Exists":
                return True
            continue
        if t.get("key") != taint.get("key"):
            continue
        if op == "Exists" or (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _expression_matches(expr: Mapping[str, Any], value: str | None) -> bool:
    op, values = expr.get("operator"), expr.get("values") or []
    if op == "In":
        return value is not None and value in values
    if op == "NotIn":
        return value is None or value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and values:
        try:
            a, b = int(value), int(values[0])
        except ValueError:
            return False
        return a > b if op == "Gt" else a < b
    return False


def _term_matches(term: Mapping[str, Any], node: NodeState, labels: Mapping[str, str]) -> bool:
    exprs = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not exprs and not fields:
        return False  # an empty term matches nothing
    return (all(_expression_matches(e, labels.get(e.get("key", ""))) for e in exprs)
            and all(_expression_matches(f, node.name if f.get("key") == "metadata.name" else None)
                    for f in fields))


def node_matches(pod: PodState, node: NodeState) -> bool:
    """Whether the scheduler may place the pod on the node at all (ignoring free resources)."""
    if not node.ready or node.unschedulable:
        return False
    if node.taints and any(t.get("effect") in BLOCKING_EFFECTS and not tolerates(pod.tolerations, t)
                           for t in node.taints):
        return False
    labels = node.label_map
    if any(labels.get(k) != v for k, v in pod.node_selector):
        return False
    return not pod.affinity_terms or any(_term_matches(t, node, labels) for t in pod.affinity_terms)


def free_capacity(nodes: Iterable[NodeState], bound: Iterable[PodState]) -> dict[str, Resources]:
    """Allocatable minus the requests of pods bound to each node and not finished."""
    free = {n.name: n.allocatable for n in nodes}
    for p in bound:
        if p.node in free and not p.terminal:
            free[p.node] = free[p.node] - p.requests
    return free


def _signature(pod: PodState) -> tuple[Any, ...]:
    return (pod.requests, pod.node_selector, repr(pod.tolerations), repr(pod.affinity_terms))


def place(pods: Sequence[PodState], nodes: Sequence[NodeState], free: dict[str, Resources],
          full: dict[tuple[Any, ...], int] | None = None) -> dict[str, str] | None:
    """First-fit-decreasing placement of every pod, or None when some pod fits nowhere.

    Pods co-located by a topology key go first, each group into the first domain (by label
    value) that holds all of it. On success `free` is updated with the placed requests; on
    failure it is left unchanged. Nodes are tried in name order, so the outcome is deterministic.
    `full`, shared by the placements of one plan (`free` only shrinks in it), remembers per pod
    shape how many nodes, in name order, no longer fit it.
    """
    return _place(pods, sorted(nodes, key=lambda n: n.name), free, full)


def _place(pods: Sequence[PodState], order: Sequence[NodeState], free: dict[str, Resources],
           full: dict[tuple[Any, ...], int] | None = None) -> dict[str, str] | None:
    """place() over nodes already in name order. Its cost grows with the pods placed, not with
    the nodes (a plan places every in-flight gang): the room it takes is kept apart from `free`
    until the whole placement succeeds."""
    taken: dict[str, Resources] = {}  # the room left on the nodes this placement uses
    placement: dict[str, str] = {}
    groups: dict[tuple[str, str], list[PodState]] = {}
    for pod in pods:
        if pod.colocated:
            groups.setdefault(pod.colocated, []).append(pod)
    for (key, _), members in sorted(groups.items()):
        domains = sorted({n.label_map.get(key) for n in order} - {None}, key=str)
        fits = (_first_fit(members, [n for n in order if n.label_map.get(key) == d], free, dict(taken))
                for d in domains)
        got = next((f for f in fits if f is not None), None)
        if got is None:
            return None
        placement.update(got[0])
        taken = got[1]
    got = _first_fit([p for p in pods if not p.colocated], order, free, taken, full)
    if got is None:
        return None
    free.update(got[1])
    return placement | got[0]


def _first_fit(pods: Sequence[PodState], order: Sequence[NodeState], free: Mapping[str, Resources],
               left: dict[str, Resources], full: dict[tuple[Any, ...], int] | None = None,
               ) -> tuple[dict[str, str], dict[str, Resources]] | None:
    """The placement of `pods` over nodes in this order, ignoring co-location, and `left` (the
    room left on nodes used so far, over `free`) with theirs; None if some pod fits nowhere.
    `full` changes only on success."""
    placement: dict[str, str] = {}
    # Pods of one gang are usually identical: remember, per shape, the first node that may
    # still fit it (capacity only shrinks during a plan, so earlier nodes stay full for it).
    start: dict[tuple[Any, ...], int] = dict(full or {})
    for pod in sorted(pods, key=lambda p: (tuple(-x for x in p.requests.key()), p.name)):
        sig = _signature(pod)
        i = start.get(sig, 0)
        while i < len(order):
            node = order[i]
            if node_matches(pod, node) and pod.requests.fits_in(_room(node.name, left, free)):
                break
            i += 1
        start[sig] = i
        if i == len(order):
            return None
        node = order[i]
        left[node.name] = _room(node.name, left, free) - pod.requests
        placement[pod.name] = node.name
    if full is not None:
        full.update(start)
    return placement, left


def _room(node: str, left: Mapping[str, Resources], free: Mapping[str, Resources]) -> Resources:
    if node in left:
        return left[node]
    return free.get(node, NO_ROOM)


@dataclass(frozen=True)
class GangRequest:
    """A complete, fully gated gang asking to be released."""

    namespace: str
    name: str
    created: datetime | None
    restart: int
    pods: tuple[PodState, ...]

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name

    def order(self) -> tuple[Any, ...]:
        return (self.created is None, self.created or datetime.min, self.namespace, self.name)


@dataclass(frozen=True)
class GangRelease:
    """A waiting gang that fits now, where each of its pods would go, and the node labels that hold
    each co-located group to the domain the fit chose for it (`pins`, pod name -> nodeSelector to
    add): the kube-scheduler places a group's first pod alone and, unpinned, may choose a domain
    too small for the rest of the group."""

    request: GangRequest
    placement: dict[str, str]
    pins: dict[str, dict[str, str]] = field(default_factory=dict)

    def pinned(self) -> tuple[PodState, ...]:
        """The gang's pods as the release leaves them, their pins in their nodeSelector."""
        return tuple(replace(p, node_selector=tuple(sorted(dict(p.node_selector, **pin).items())))
                     if (pin := self.pins.get(p.name)) else p for p in self.request.pods)


def _pins(pods: Iterable[PodState], placement: Mapping[str, str],
          nodes: Mapping[str, NodeState]) -> dict[str, dict[str, str]]:
    """Each co-located pod's domain: its topology key's value on the node its group was placed in."""
    return {p.name: {p.colocated[0]: nodes[placement[p.name]].label_map[p.colocated[0]]}
            for p in pods if p.colocated}


def plan_admission(nodes: Sequence[NodeState], bound: Iterable[PodState],
                   in_flight: Iterable[Sequence[PodState]],
                   waiting: Iterable[GangRequest]) -> list[GangRelease]:
    """Which waiting gangs to release now, oldest first (best-effort FIFO).

    `bound` are pods with a node; `in_flight` are gangs already released whose pods are not all
    bound yet: they are placed first so two gangs that fit only one at a time never both go.
    If an in-flight gang fits nowhere, nothing is released, unless what does not fit are pods no
    node may take at all (their nodes gone or NotReady): those bind nowhere and hold no room. A
    pod being deleted holds none either. A waiting gang that does not fit is skipped and a later,
    smaller one may still go.
    """
    free = free_capacity(nodes, bound)
    nodes = sorted(nodes, key=lambda n: n.name)
    full: dict[tuple[Any, ...], int] = {}
    for gang in in_flight:
        unbound = [p for p in gang if p.node is None and not p.terminal and not p.deleting]
        if _place(unbound, nodes, free, full) is None:
            placeable = [p for p in unbound if any(node_matches(p, n) for n in nodes)]
            if len(placeable) == len(unbound) or _place(placeable, nodes, free, full) is None:
                # A released gang we cannot place: our view disagrees with the scheduler's (or the
                # room went to someone else). Release nothing until it binds or its gang times out.
                return []
    by_name = {n.name: n for n in nodes}
    admitted = []
    for req in sorted(waiting, key=GangRequest.order):
        placement = _place(req.pods, nodes, free, full)
        if placement is not None:
            admitted.append(GangRelease(req, placement, _pins(req.pods, placement, by_name)))
    return admitted


def room(nodes: Sequence[NodeState], bound: Iterable[PodState], in_flight: Iterable[Sequence[PodState]],
         pod: PodState, limit: int) -> int:
    """How many pods like `pod` fit at once (at most `limit`), beside the bound pods and the gangs
    released and not yet bound (placed first, as plan_admission places them)."""
    free = free_capacity(nodes, bound)
    order = sorted(nodes, key=lambda n: n.name)
    full: dict[tuple[Any, ...], int] = {}
    for gang in in_flight:
        _place([p for p in gang if p.node is None and not p.terminal and not p.deleting], order, free, full)
    fits = 0
    while fits < limit and _place([replace(pod, name=f"{pod.name}-room-{fits}", node=None)], order, free,
                                  full) is not None:
        fits += 1
    return fits
