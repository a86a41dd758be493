"""A node's supervisor: the pod's first process, around torchrun.

It waits for pod 0's name (a worker node, tetrad.node.rendezvous; one that never resolves exits 69 like a
failed check), checks the node (the preflight gate, tetrad.node.checks), runs torchrun as a child with the stop signals forwarded, then turns what torchrun
and its workers reported in the exit directory (tetrad.node.exits) into the node's exit code and the
pod's termination message (tetrad.api.termination), which it alone writes. torchrun alone exits 1 for
any worker failure; the node exits with the workers' own code instead: 75 when every local worker
reported 75 (preempted, saved), 78, 77, 69 or 79 when any worker reported it, a worker's own non-zero
code, torchrun's code otherwise.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from tetrad.api.contract import ENV_EXIT_DIR, EXIT_COLLECTIVE_TIMEOUT, EXIT_PREFLIGHT
from tetrad.api.termination import TerminationMessage
from tetrad.node import checks, collective, exits
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
        print(f"[tetrad] could not write the termination message to {env.termination_log}: {e}", file=sys.stderr,
              flush=True)


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
    write_termination_message(exits.compose(messages, first_timeout), env)
    return final
