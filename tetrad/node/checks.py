"""The preflight gate's checks of one node, before torchrun starts: its devices (a GPU job needs
nprocPerNode visible CUDA devices), the CPUs resources.cpu requests (in a pod: this process's CPU
affinity, what a static CPU manager or `taskset` leaves it), and pod 0's rendezvous name resolving
within the gate's timeout. A node that fails exits EXIT_PREFLIGHT (69) without starting torchrun,
naming itself and the reason in its termination message."""

from __future__ import annotations

import math
import os
import subprocess
import sys

from tetrad.api.termination import NodeFailure, rendezvous_failure
from tetrad.node.environment import NodeEnv
from tetrad.node.rendezvous import resolves

# How the node counts its CUDA devices: torch's own count, in a child (the launcher imports no torch).
COUNT_DEVICES = "import torch; print(torch.cuda.device_count())"


def cuda_devices(timeout_s: float) -> tuple[int, str]:
    """(CUDA devices torch sees, "" or why it could not tell)."""
    try:
        r = subprocess.run([sys.executable, "-c", COUNT_DEVICES], capture_output=True, text=True,
                           timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 0, f" (torch could not be asked: {e})"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return 0, f" (torch could not count them: {last})"
    return int(r.stdout.strip() or 0), ""


def available_cpus() -> int:
    """CPUs this process may run on (its affinity; no cgroup quota is read)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def node_problems(env: NodeEnv) -> list[str]:
    """What this node lacks for the job: devices, CPUs, pod 0's name."""
    assert env.preflight is not None
    problems = []
    if env.gpus and env.nproc is not None:
        have, why = cuda_devices(env.preflight.timeout_seconds)
        if have < env.nproc:
            problems.append(f"devices: {have} CUDA devices visible{why}, the job runs "
                            f"nprocPerNode={env.nproc} processes, one per GPU")
    if env.in_pod and env.cpus is not None and (have := available_cpus()) < math.ceil(env.cpus):
        problems.append(f"cpu: resources.cpu requests {env.cpus:g} CPUs, this node's processes may run on "
                        f"{have} (their CPU affinity)")
    if env.master_addr and (error := resolves(env.master_addr, env.preflight.timeout_seconds)) is not None:
        problems.append(rendezvous_failure(env.master_addr, env.preflight.timeout_seconds, error))
    return problems


def node_failures(env: NodeEnv) -> list[NodeFailure]:
    """The checks' failures, each naming this node; none when the gate is off."""
    if env.preflight is None:
        return []
    return [NodeFailure(env.node_name, env.node_rank, problem) for problem in node_problems(env)]


def describe(f: NodeFailure) -> str:
    where = "the gang" if f.node is None else f"node {f.node} (node rank {f.node_rank})"
    return f"preflight failed on {where}: {f.reason}"
