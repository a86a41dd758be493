"""The preflight gate, operator side.

A trainer pod that fails the gate exits EXIT_PREFLIGHT (69) with a termination message naming the
failing nodes and why (tetrad.api.termination). The failure restarts the gang as a disruption
(policy.py); `record` names each node in status.failedNodes with the reason and, while
spec.preflight.excludeFailedNodes allows it and maxExcludedNodes is not spent, excludes it:
`excluded` lists the nodes the next incarnations' pods must avoid (a required node anti-affinity,
tetrad.render.objects.avoiding). A node where pod 0's name did not resolve is named, not excluded: that
says nothing against the node (pod 0 was not running, or the cluster's DNS failed), and avoiding
healthy nodes could leave the gang nowhere to run. `report_slow` judges the bandwidth the scraper read into
status.preflight for the current incarnation: nodes below spec.preflight.slowNodeFraction of the
median make the SlowNodes condition and a Warning Event.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from tetrad.api.slow_nodes import slow_nodes
from tetrad.api.spec import FailedNode, ParallelTrainingJobStatus, Preflight
from tetrad.api.termination import blames_the_node
from tetrad_operator.lifecycle.actions import Event
from tetrad_operator.lifecycle.machine import JobPass
from tetrad_operator.observed import PodState

SLOW_NODES = "SlowNodes"  # the condition
KEPT_FAILURES = 20  # entries of status.failedNodes kept besides the excluded ones (the newest)


def named_nodes(pod: PodState, current: Mapping[int, PodState]) -> tuple[list[tuple[str, str]], list[str]]:
    """((node, reason) for each node the pod's termination message names, the reasons that name
    none). A node rank maps to the node its pod is bound to, which the API server knows best; a pod
    that left no message names its own node."""
    nodes, gang = [], []
    said = pod.said.preflight
    for f in said:
        bound = current.get(f.node_rank) if f.node_rank is not None else None
        node = (bound.node if bound is not None and bound.node else None) or f.node
        if node:
            nodes.append((node, f.reason))
        else:
            gang.append(f.reason)
    if not said and pod.node:
        nodes.append((pod.node,
                      "exited 69 (the preflight gate) without a termination message; see the pod log"))
    return nodes, gang


def excluded(status: ParallelTrainingJobStatus) -> list[str]:
    """The nodes later incarnations avoid."""
    return sorted({f.node for f in status.failed_nodes if f.excluded})


def record(m: JobPass, nodes: list[tuple[str, str]], restart: int, spec: Preflight,
           cause: str = "failed the preflight gate") -> None:
    """Name the failed nodes of incarnation `restart` in status.failedNodes; exclude those the
    budget allows. `cause`: what they did, for the Events (a slow node's, lifecycle/stragglers.py)."""
    failed = list(m.status.failed_nodes)
    avoided = set(excluded(m.status))
    for node, reason in nodes:
        if any(f.node == node and f.restart == restart for f in failed):
            continue  # a later pass over the same failure
        at_fault = blames_the_node(reason)
        exclude = (at_fault and spec.exclude_failed_nodes
                   and (node in avoided or len(avoided) < spec.max_excluded_nodes))
        if exclude and node not in avoided:
            avoided.add(node)
            m.decision.events.append(Event("Warning", "NodeExcluded",
                                           f"node {node} {cause} "
                                           f"({reason}); the next pods avoid it ({len(avoided)} of "
                                           f"spec.preflight.maxExcludedNodes={spec.max_excluded_nodes} "
                                           f"excluded)"))
        elif not exclude:
            why = ("pod 0's name not resolving there says nothing against the node" if not at_fault else
                   "spec.preflight.excludeFailedNodes is false" if not spec.exclude_failed_nodes else
                   f"spec.preflight.maxExcludedNodes={spec.max_excluded_nodes} nodes are excluded already")
            m.decision.events.append(Event("Warning", "NodeNotExcluded",
                                           f"node {node} {cause} "
                                           f"({reason}); not excluded: {why}"))
        failed.append(FailedNode(node=node, reason=reason, restart=restart, excluded=exclude))
    kept = [f for f in failed if f.excluded]
    m.status.failed_nodes = kept + [f for f in failed if not f.excluded][-KEPT_FAILURES:]


def report_slow(m: JobPass, restart: int, fraction: float) -> None:
    """Condition SlowNodes (and a Warning Event when it turns True or names other nodes): the nodes
    whose bus bandwidth in the current incarnation's preflight, as the scraper read it into
    status.preflight, is below `fraction` of the median."""
    measured = m.read.preflight
    if measured is None or measured.restart != restart:
        return  # not measured in this incarnation yet
    bandwidth: dict[str, float] = {}
    for n in measured.nodes:
        bandwidth[n.node] = min(n.bus_bandwidth_g_bps, bandwidth.get(n.node, n.bus_bandwidth_g_bps))
    slow = slow_nodes(bandwidth, fraction)
    if slow:
        median = statistics.median(bandwidth.values())
        m.warn(SLOW_NODES, f"node{'s' if len(slow) > 1 else ''} {', '.join(slow)} measured a preflight "
                           f"all-reduce bus bandwidth below spec.preflight.slowNodeFraction={fraction:g} of "
                           f"the gang's median ({median:.3g} GB/s): "
                           + ", ".join(f"{node} {bandwidth[node]:.3g} GB/s" for node in slow))
    else:
        m.unwarn(SLOW_NODES, "NoSlowNodes", f"restart {restart}: no node below the fraction")
