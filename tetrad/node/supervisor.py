"""A node's supervisor: the pod's first process, around torchrun.

It waits for pod 0's name (a worker node, tetrad.node.rendezvous; one that never resolves exits 69 like a
failed check), checks the node (the preflight gate, tetrad.node.checks), runs torchrun as a child with the
stop signals forwarded, then turns what torchrun
and its workers reported in the exit directory (tetrad.node.exits) into the node's exit code and the
pod's termination message (tetrad.api.termination), which it alone writes. torchrun alone exits 1 for
any worker failure; the node exits with the workers' own code instead: 75 when every local worker
reported 75 (preempted, saved), 78, 77, 69 or 79 when any worker reported it, a worker's own non-zero
code, torchrun's code otherwise; 77 when the kernel's OOM killer ended a worker that said nothing
(tetrad.node.oom_killer).
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from tetrad.api.contract import (
    ENV_EXIT_DIR,
    EXIT_COLLECTIVE_TIMEOUT,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_PREFLIGHT,
    REASON_HOST_OUT_OF_MEMORY,
)
from tetrad.api.termination import TerminationMessage
from tetrad.node import checks, collective, exits, oom_killer
from tetrad.node.environment import NodeEnv
from tetrad.node.process import run_forwarding
from tetrad.node.rendezvous import wait_for_master


def write_termination_message(message: TerminationMessage, env: NodeEnv) -> None:
    """The pod's termination message, where Kubernetes reads it; elsewhere nothing is written."""
    text = message.encode()
    if env.termination_log is None or not text:
        return
    try:
        env.termination_log.write_text(text)
    except OSError as e:
        print(f"[tetrad] could not write the termination message to {env.termination_log}: {e}",
              file=sys.stderr, flush=True)


def before_torchrun(env: NodeEnv) -> int | None:
    """Pod 0's name (a worker node waits for it), then the node's preflight checks: EXIT_PREFLIGHT after
    naming the failures, None to go on."""
    unresolved = wait_for_master(env)
    failures = [unresolved] if unresolved is not None else checks.node_failures(env)
    if not failures:
        return None
    for f in failures:
        print(f"[tetrad] {checks.describe(f)}", file=sys.stderr, flush=True)
    write_termination_message(TerminationMessage(preflight=tuple(failures)), env)
    return EXIT_PREFLIGHT


def supervise(command: list[str], env: NodeEnv) -> int:
    """Wait for the master's name (a worker node), check the node, run `command` (torchrun ...) with
    signals forwarded; return the node's exit code."""
    if (failed := before_torchrun(env)) is not None:
        return failed
    kills = oom_killer.oom_kills()
    with tempfile.TemporaryDirectory(prefix="tetrad-exit-") as exit_dir:
        directory = Path(exit_dir)
        code = run_forwarding(command, {**os.environ, ENV_EXIT_DIR: exit_dir})
        codes = list(exits.reported_codes(directory).values())
        messages = exits.reported_messages(directory)
        timeouts = {rank: m.collective_timeout for rank, m in messages.items() if m.collective_timeout}
        aborted = collective.dumped(directory)  # NCCL aborts without reporting
    if aborted:
        codes.append(EXIT_COLLECTIVE_TIMEOUT)
    timeouts = {**aborted, **timeouts}
    final = exits.node_exit_code(code, codes, env.nproc)
    if final != code:
        print(f"[tetrad] torchrun exited {code}; the workers reported {sorted(set(codes))}: exiting {final}",
              file=sys.stderr, flush=True)
    first_timeout = timeouts[min(timeouts)] if timeouts else None
    message = exits.compose(messages, first_timeout)
    said_why = any(c in exits.NODE_CAUSES for c in codes)
    if final not in (0, EXIT_PREEMPTED) and not said_why and (killed := oom_killer.killed_since(kills)):
        why = out_of_host_memory(killed, kills[1] if kills else None)
        print(f"[tetrad] error: {why}", file=sys.stderr, flush=True)
        final, message = EXIT_OOM, replace(message, reason=REASON_HOST_OUT_OF_MEMORY, message=why)
    write_termination_message(message, env)
    return final


def out_of_host_memory(killed: int, counter: Path | None) -> str:
    where = ("this machine" if counter == Path("/proc/vmstat")
             else "this node's memory cgroup (the pod's limit)")
    return (f"the kernel's out-of-memory killer ended {killed} process(es) in {where} while the workers ran,"
            " and a worker died without a word: its host memory ran out. Raise spec.resources.memory (the"
            " planner's estimate: tetrad plan), or use fewer processes per node, a smaller model, batch or"
            " seqLen")
