"""Faults the trainer injects for tests, and only for tests.

$TETRAD_TEST_FAULT names one fault:

  hang-rank:R:step:S   rank R blocks forever at the start of step S (its peers wait in their next
                       collective until the collective timeout)
  fail-rank:R:step:S   rank R fails at the start of step S with a config error (exit 78) while its
                       peers wait in their next collective
  slow-rank:R:ms:M     rank R computes M ms longer in every step (a busy loop: a slower device)

It is read here and nowhere else, and it acts only when $TETRAD_TEST_FAULTS_ALLOWED=1 is set as
well; without that, the trainer logs that it ignores it. It acts in the first round of restarts in place
only (tetrad.node.rounds): the restart is what such a test watches, and it must get past the fault. A
pod's template cannot set either variable (TETRAD_* is reserved), so a real job never runs with a fault.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass

from tetrad.api.contract import ENV_TEST_FAULT, ENV_TEST_FAULTS_ALLOWED
from tetrad.node.environment import WorkerEnv
from tetrad_trainer.config import ConfigError

FAULT = re.compile(r"(hang|fail)-rank:(\d+):step:(\d+)|slow-rank:(\d+):ms:(\d+)")


@dataclass(frozen=True)
class Hang:
    rank: int
    step: int


@dataclass(frozen=True)
class Fail:
    rank: int
    step: int


@dataclass(frozen=True)
class Slow:
    rank: int
    ms: int


Fault = Hang | Fail | Slow


def configured(env: WorkerEnv | None = None) -> Fault | None:
    """The fault $TETRAD_TEST_FAULT asks for, when tests allow faults; None otherwise."""
    env = env or WorkerEnv.read()
    if not (spec := env.test_fault):
        return None
    if not env.test_faults_allowed:
        print(f"[tetrad] ignoring {ENV_TEST_FAULT}={spec}: test faults act only with "
              f"{ENV_TEST_FAULTS_ALLOWED}=1", file=sys.stderr, flush=True)
        return None
    if env.node.round > 0:
        print(f"[tetrad] ignoring {ENV_TEST_FAULT}={spec} in round {env.node.round}: test faults act in the"
              " first round of restarts in place only", file=sys.stderr, flush=True)
        return None
    if not (m := FAULT.fullmatch(spec)):
        raise ConfigError(f"{ENV_TEST_FAULT}={spec!r} is not a fault; use hang-rank:RANK:step:STEP,"
                          " fail-rank:RANK:step:STEP or slow-rank:RANK:ms:MS")
    if m[4] is not None:
        return Slow(rank=int(m[4]), ms=int(m[5]))
    return (Hang if m[1] == "hang" else Fail)(rank=int(m[2]), step=int(m[3]))


def slow_down(fault: Fault | None, rank: int) -> None:
    """Busy for the slow fault's milliseconds when it is this rank's (inside the step's compute)."""
    if isinstance(fault, Slow) and fault.rank == rank:
        end = time.thread_time() + fault.ms / 1000
        while time.thread_time() < end:
            pass


def inject(fault: Fault | None, rank: int, step: int) -> None:
    """Block forever when `fault` is this rank's hang at this step (signals are still handled, only SIGKILL
    ends it); raise ConfigError when it is this rank's failure."""
    if not isinstance(fault, Hang | Fail) or (fault.rank, fault.step) != (rank, step):
        return
    if isinstance(fault, Fail):
        raise ConfigError(f"{ENV_TEST_FAULT}: failing at the start of step {step} (test fault)")
    print(f"[tetrad rank {rank}] {ENV_TEST_FAULT}: hanging at the start of step {step} (test fault)",
          file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)
