"""A node's supervisor: the pod's first process, around torchrun.

It waits for pod 0's name (a worker node, tetrad.node.rendezvous; one that never resolves exits 69 like a
failed check), checks the node (the preflight gate, tetrad.node.checks), runs torchrun as a child with the
stop signals forwarded (again for each restart in place, tetrad.node.rounds), then turns what torchrun
and its workers reported in the exit directory (tetrad.node.exits) into the node's exit code and the
pod's termination message (tetrad.api.termination), which it alone writes. torchrun alone exits 1 for
any worker failure; the node exits with the workers' own code instead: 75 when every local worker
reported 75 (preempted, saved), 78, 77, 69 or 79 when any worker reported it, a worker's own non-zero
code, torchrun's code otherwise; 77 when the kernel's OOM killer ended a worker that said nothing
(tetrad.node.oom_killer).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

from tetrad.api import restart_policy
from tetrad.api.contract import (
    ENV_EXIT_DIR,
    ENV_ROUND,
    ENV_ROUND_CAUSE,
    EXIT_COLLECTIVE_TIMEOUT,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_PREFLIGHT,
    EXIT_WORKERS_STUCK,
    REASON_HOST_OUT_OF_MEMORY,
    REASON_RESTART_ASKED,
    REASON_STALLED,
    REASON_WORKERS_STUCK,
)
from tetrad.api.termination import TerminationMessage
from tetrad.node import checks, collective, exits, oom_killer, rounds
from tetrad.node.environment import NodeEnv
from tetrad.node.failure import FirstFailure, children
from tetrad.node.process import STOP_SIGNALS, StopRequested, kill_all_with, run_abortable
from tetrad.node.rendezvous import wait_for_master
from tetrad.node.spare import ENV_SPARE_SOCKET, Spare, runnable

WORKERS_GONE_TIMEOUT_S = 30.0
TORCHRUN_SHUTDOWN_S = 30.0  # torchrun's wait for its workers after SIGTERM, when the pod does not set it
SAVE_MARGIN_S = 5.0  # more than that for torchrun to exit, before the supervisor SIGKILLs it
SPARE_AFTER_S = 60.0  # into a round, once its start-up is likely over, the next round's spare starts
SPARE_ROOM_BYTES = 1 << 30  # the room a spare needs: torch imported (0.4-0.7 GiB), and a margin
TORCHRUN_FAILED = 1  # torchrun's exit code when a worker failed
SILENT_WORKER = "a worker ended without a word: killed by a signal, or crashed"


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
    signals forwarded, round after round while the gang restarts in place (tetrad.node.rounds); return the
    node's exit code."""
    if (failed := before_torchrun(env)) is not None:
        return failed
    spares = Spares(env.rounds is not None and env.spare and runnable(command[1:]),
                    ahead=env.rounds is not None and env.rounds.left > 0)
    with joined_rounds(env) as member, BetweenRounds() as stops, spares:
        round, cause = 0, None
        while True:
            ended = run_round(command, env, round, member, cause, spares, lambda: stops.received)
            if stops.received is not None and ended.final is not None:
                ended = stopped_during(ended, stops.received)
                if member is not None:  # the pod is going away: so do the rounds
                    report(member, env, round, ended, stopping=True)
            try:
                with stops.raised():  # between rounds no worker runs: a stop ends the node at once
                    word = next_word(member, env, round, ended)
                    if word is not None and word.kind == rounds.GO:
                        round, cause = word.round, failure(word)
                        settings = env.rounds
                        assert settings is not None
                        wait = restart_policy.backoff_seconds(settings.backoff_s, settings.backoff_max_s,
                                                              settings.restarts + round)
                        print(f"[tetrad] {restarting(word, wait)}", file=sys.stderr, flush=True)
                        spares.prepare()
                        spares.ahead = (word.left or 0) > 0
                        time.sleep(wait)
                        continue
            except StopRequested as stop:
                final, message = last_word(ended, None, stop.signum)
            else:
                final, message = last_word(ended, word, None, save_seconds(env))
            write_termination_message(replace(message, round=round), env)
            return final


class Spares:
    """The next round's spare interpreter (tetrad.node.spare): started during this round when the budget
    has a restart left (`ahead`), else when the gang restarts in place (an operator's ask spends none), and
    taken by the next round. None when restarts in place are off, TETRAD_SPARE=0, the command is not one a
    spare can run, or the pod's memory has no room for it (said once)."""

    def __init__(self, enabled: bool, ahead: bool = True) -> None:
        self.enabled, self.ahead = enabled, ahead
        self.next: Spare | None = None
        self.said_no_room = False

    def __enter__(self) -> Spares:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.next is not None:
            self.next.close()

    def prepare(self) -> None:
        if not self.enabled or self.next is not None:
            return
        if (room := oom_killer.room_bytes()) is not None and room < SPARE_ROOM_BYTES:
            if not self.said_no_room:
                print(f"[tetrad] no spare interpreter for the next round: {room / 2**30:.1f} GiB of memory"
                      f" left, it needs {SPARE_ROOM_BYTES / 2**30:g} GiB (a restart in place starts cold)",
                      file=sys.stderr, flush=True)
                self.said_no_room = True
            return
        try:
            self.next = Spare()
        except OSError as e:  # the round starts as the first did
            print(f"[tetrad] no spare interpreter for the next round: {e}", file=sys.stderr, flush=True)
            self.enabled = False

    def take(self) -> Spare | None:
        spare, self.next = self.next, None
        return spare


class BetweenRounds:
    """The supervisor's stop signals (SIGTERM, SIGINT, SIGHUP) while torchrun is not running (during a
    round, run_abortable forwards them to it): recorded, and raised as StopRequested inside `raised()`."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._raising = False
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> BetweenRounds:
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signum
        if self._raising:
            raise StopRequested(signum)

    @contextlib.contextmanager
    def raised(self) -> Iterator[None]:
        if self.received is not None:  # it came while the last round was being read
            raise StopRequested(self.received)
        self._raising = True
        try:
            yield
        finally:
            self._raising = False


def last_word(ended: RoundEnd, word: rounds.Word | None, stop: int | None,
              save_s: float = 0.0) -> tuple[int, TerminationMessage]:
    """The node's exit code and termination message once its rounds are over: its own failure when it had
    one, else why it stopped (a stop signal, or the word that ended the rounds; `save_s`: the time the
    rounds give an abort that saves first)."""
    if ended.final is not None:
        return ended.final, ended.message
    if stop is not None:
        return 128 + stop, TerminationMessage(message=f"stopped by {signal.Signals(stop).name} between"
                                                      " restarts in place, its workers already gone")
    if word is not None and word.node == rounds.OPERATOR:  # the operator reads it as the ask it made
        return 1, TerminationMessage(reason=REASON_RESTART_ASKED if word.save else REASON_STALLED, message=(
            f"{word.why}; the gang was asked to restart in place, but a node did not stop within"
            f" {rounds.stop_timeout(word, save_s):g}s or was lost: the gang needs new pods"))
    return (word.code if word is not None and word.code else 1), TerminationMessage(message=stopped_for(word))


def stopped_during(ended: RoundEnd, signum: int) -> RoundEnd:
    """A round that a stop signal ended: workers that ended without a word (most likely still starting)
    were stopped, not failed."""
    if not ended.silent:
        return ended
    return RoundEnd(128 + signum, TerminationMessage(message=(
        f"stopped by {signal.Signals(signum).name} before its workers could save: they ended without a"
        " word, most likely still starting")))


@dataclass(frozen=True)
class RoundEnd:
    final: int | None  # the node's exit code; None: stopped for an abort
    message: TerminationMessage
    silent: bool = False  # a worker ended without a word (killed by a signal, or crashed)

    @property
    def why(self) -> str | None:
        if self.message.reason and self.message.message:
            return f"{self.message.reason}: {self.message.message}"
        if self.message.collective_timeout:
            return f"a collective timed out: {self.message.collective_timeout}"
        return SILENT_WORKER if self.silent else None


def run_round(command: list[str], env: NodeEnv, round: int, member: rounds.Member | None,
              cause: str | None = None, spares: Spares | None = None,
              stopped: Callable[[], int | None] = lambda: None) -> RoundEnd:
    """One torchrun, and what it and its workers reported: the node's exit code and termination message.
    An abort of the round kills it and waits until none of its workers is left. The workers learn the
    round and the `cause` that began it from their environment. The spare the last round started forks
    this round's processes, and this round starts the next one's SPARE_AFTER_S in. A stop signal the node
    already got (`stopped`) starts no torchrun."""
    kills = oom_killer.oom_kills()
    spare = spares.take() if spares is not None else None
    began = time.monotonic()
    failed: list[str] = []  # the first failed worker, when the supervisor saw it before torchrun ended

    def abort(member: rounds.Member, first: FirstFailure, torchrun: int) -> float | None:
        """How long torchrun (or its relay) has to stop, once the round is aborted or has failed; None: let it
        run."""
        if spares is not None and spares.ahead and time.monotonic() - began > SPARE_AFTER_S:
            spares.prepare()
        if (word := member.aborted(round)) is not None:
            return save_seconds(env) if word.save else 0.0
        if (why := first.check([torchrun] if spare is None else children(spare.process.pid))) is not None:
            print(f"[tetrad] {why}: stopping the round's other workers at once (none can save without it)",
                  file=sys.stderr, flush=True)
            failed.append(why)
            return 0.0
        return None

    with contextlib.ExitStack() as stack:
        round_env = {ENV_ROUND: str(round), **({ENV_ROUND_CAUSE: cause} if cause else {})}
        if spare is not None:
            stack.callback(spare.close)
            exit_dir, command = spare.exit_dir, spare.command(command)
            round_env[ENV_SPARE_SOCKET] = spare.socket
        else:
            exit_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="tetrad-exit-"))
        directory = Path(exit_dir)
        try:
            code = run_abortable(command, {**os.environ, ENV_EXIT_DIR: exit_dir, **round_env},
                                 None if member is None else functools.partial(abort, member,
                                                                               FirstFailure(directory)),
                                 stopped)
        except StopRequested as stop:
            return RoundEnd(128 + stop.signum, TerminationMessage(message=(
                f"stopped by {signal.Signals(stop.signum).name} before round {round}'s workers started")))
        if code is None:
            if left := kill_all_with(ENV_EXIT_DIR, exit_dir, WORKERS_GONE_TIMEOUT_S):
                why = (f"workers {left} of round {round} are still there {WORKERS_GONE_TIMEOUT_S:g}s after"
                       " SIGKILL (stuck in the kernel): the gang needs new pods")
                print(f"[tetrad] error: {why}", file=sys.stderr, flush=True)
                return RoundEnd(EXIT_WORKERS_STUCK, TerminationMessage(reason=REASON_WORKERS_STUCK,
                                                                       message=why))
            if not failed:
                return RoundEnd(None, TerminationMessage())
            code = TORCHRUN_FAILED  # as torchrun would have exited, its workers stopped
        codes = list(exits.reported_codes(directory).values())
        messages = exits.reported_messages(directory)
        timeouts = {rank: m.collective_timeout for rank, m in messages.items() if m.collective_timeout}
        aborted = collective.dumped(directory)  # NCCL aborts without reporting
    if aborted:
        codes.append(EXIT_COLLECTIVE_TIMEOUT)
    timeouts = {**aborted, **timeouts}
    silent = code != 0 and env.nproc is not None and len(codes) < env.nproc
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
    return RoundEnd(final, message, silent)


@contextlib.contextmanager
def joined_rounds(env: NodeEnv) -> Iterator[rounds.Member | None]:
    """This node's member of the rounds (node 0 runs the coordinator too); None when they are off."""
    settings = env.rounds
    if settings is None:
        yield None
        return
    gang = rounds.gang_id(env.rdzv_id, env.restart, settings.token)
    coordinator = None
    if env.node_rank == 0:
        host = "" if env.in_pod else settings.host
        try:
            coordinator = rounds.Coordinator(rounds.Rounds(env.nodes, settings.left), gang, host,
                                             settings.port, save_seconds(env))
        except OSError as e:  # every node is on its own: a failure ends the run as without rounds
            print(f"[tetrad] no restarts in place: port {settings.port} for them: {e}", file=sys.stderr,
                  flush=True)
    member = rounds.Member(env.node_rank, gang, settings.host, settings.port, env.rdzv_timeout_s)
    try:
        yield member
    finally:
        member.close()
        if coordinator is not None:
            coordinator.close()


def next_word(member: rounds.Member | None, env: NodeEnv, round: int, ended: RoundEnd) -> rounds.Word | None:
    """Report how this node's round ended and hear what the gang does next: None when it finished or is on
    its own."""
    if member is None or not report(member, env, round, ended) or ended.final == 0:
        return None
    return member.next_word(round)


def report(member: rounds.Member, env: NodeEnv, round: int, ended: RoundEnd, stopping: bool = False) -> bool:
    """Tell the coordinator how this node's round ended: whether it heard. A node told to stop (`stopping`)
    never restarts in place: its pod is going away."""
    settings = env.rounds
    assert settings is not None
    in_place = not stopping and ended.final not in (None, 0) and restart_policy.in_place(
        ended.final, retryable=settings.retryable, permanent=settings.permanent)
    return member.report(rounds.Report(env.node_rank, round, ended.final, in_place, ended.why))


def save_seconds(env: NodeEnv) -> float:
    """How long a round that saves first gives torchrun after its SIGTERM: torchrun's own wait for its
    workers, which save and exit, and a margin."""
    return (env.shutdown_timeout_s or TORCHRUN_SHUTDOWN_S) + SAVE_MARGIN_S


def restarting(word: rounds.Word, wait: float) -> str:
    asked = "asked, saving first" if word.save else "a disruption"
    budget = (f"{asked}, spending no spec.runPolicy.maxRestarts" if word.node == rounds.OPERATOR
              else f"spec.runPolicy.maxRestarts: {word.left} left")
    return f"{failure(word)}: {rounds.RESTARTING}, round {word.round}, in {wait:g}s ({budget})"


def stopped_for(word: rounds.Word | None) -> str:
    if word is None:
        return "stopped for a restart in place that did not come: the coordinator on node 0 is gone"
    return f"stopped for a peer: {failure(word)}; the gang does not restart in place"


def failure(word: rounds.Word) -> str:
    if word.node == rounds.OPERATOR:
        return word.why or "the operator asked"
    return f"node {word.node} exited {word.code}" + (f" ({word.why})" if word.why else "")


def out_of_host_memory(killed: int, counter: Path | None) -> str:
    where = ("this machine" if counter == Path("/proc/vmstat")
             else "this node's memory cgroup (the pod's limit)")
    return (f"the kernel's out-of-memory killer ended {killed} process(es) in {where} while the workers ran,"
            " and a worker died without a word: its host memory ran out. Raise spec.resources.memory (the"
            " planner's estimate: tetrad plan), or use fewer processes per node, a smaller model, batch or"
            " seqLen")
