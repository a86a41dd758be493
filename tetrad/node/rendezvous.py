"""Pod 0's name, which every node's torchrun needs to reach the rendezvous.

Pod 0's name appears in DNS once it has an IP (the Service publishes not-ready addresses), so a
worker scheduled before it waits, bounded by the rendezvous timeout, instead of failing: the
supervisor (tetrad.node.supervisor) calls `wait_for_master` before anything else. A name that never
resolves is a preflight failure (exit 69, the cluster's fault rather than the job's), not a crash. The
wait runs in the trainer's container rather than an init container of its own: a second container,
with its status and managed fields, made each worker pod a sixth larger for every watcher of pods to
decode.
"""

from __future__ import annotations

import socket
import threading
import time

from tetrad.api.termination import NodeFailure, rendezvous_failure
from tetrad.node.environment import NodeEnv

RESOLVE_RETRY_S = 1.0
FIRST_LOOKUP_S = 0.5  # how long the first lookup may take before the wait is announced
LAST_LOOKUP_S = 0.2  # the least time a lookup at the deadline gets to answer


def _lookup(name: str, answer: list[str]) -> None:
    try:
        socket.getaddrinfo(name, None)
        answer.append("")
    except OSError as e:
        answer.append(str(e) or type(e).__name__)


def resolves(name: str, timeout_s: float, retry_s: float = RESOLVE_RETRY_S) -> str | None:
    """None when `name` resolves within `timeout_s` (retrying), else the last resolver error."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer: list[str] = []
        # getaddrinfo has no timeout
        thread = threading.Thread(target=_lookup, args=(name, answer), daemon=True)
        thread.start()
        thread.join(max(LAST_LOOKUP_S, deadline - time.monotonic()))
        if answer and not answer[0]:
            return None
        error = answer[0] if answer else f"no answer in {timeout_s:g} s"
        if (left := deadline - time.monotonic()) <= 0:
            return error
        time.sleep(min(retry_s, left))  # the last lookup is at the deadline, not a retry before it


def wait_for_master(env: NodeEnv, retry_s: float = RESOLVE_RETRY_S) -> NodeFailure | None:
    """On a worker node (node rank above 0), wait for pod 0's name up to the rendezvous timeout. None
    to go on, or the node's failure when it never resolved."""
    host = env.master_addr
    if not host or env.node_rank == 0:
        return None
    if resolves(host, FIRST_LOOKUP_S) is None:  # pod 0 usually exists already: say nothing
        return None
    timeout = env.rdzv_timeout_s
    print(f"[tetrad] waiting up to {timeout:g} s for pod 0's name {host} to resolve", flush=True)
    if (error := resolves(host, timeout, retry_s)) is None:
        print(f"[tetrad] {host} resolves", flush=True)
        return None
    return NodeFailure(env.node_name, env.node_rank, rendezvous_failure(host, timeout, error))
