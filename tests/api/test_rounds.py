"""Restarts in place: the coordinator's decisions (tetrad.node.rounds.Rounds) and the rule they share with
the operator (tetrad.api.restart_policy), then the same over real sockets between threads."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tetrad.api import restart_policy
from tetrad.api.contract import (
    ENV_ROUND,
    ENV_ROUND_CAUSE,
    EXIT_COLLECTIVE_TIMEOUT,
    EXIT_CONFIG_ERROR,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_PREFLIGHT,
    EXIT_WORKERS_STUCK,
    REASON_RESTART_ASKED,
    REASON_STALLED,
    REASON_WORKERS_STUCK,
)
from tetrad.api.termination import TerminationMessage
from tetrad.launch.local import restarts_row
from tetrad.node import rounds as rounds_module
from tetrad.node import supervisor
from tetrad.node.environment import NodeEnv, RoundSettings
from tetrad.node.failure import COLLECTIVE_TIMEOUT_GRACE_S, FirstFailure
from tetrad.node.process import StopRequested, run_abortable, run_forwarding
from tetrad.node.rounds import ABORT, END, GO, OPERATOR, Coordinator, Member, Report, Rounds, Word
from tetrad.node.spare import READY

DEFAULT = {"retryable": (), "permanent": (EXIT_OOM, EXIT_CONFIG_ERROR)}


@pytest.mark.parametrize(("code", "in_place"), [
    (1, True), (137, True), (EXIT_COLLECTIVE_TIMEOUT, True),  # the job's processes failed: the pods are fine
    (0, False), (EXIT_PREEMPTED, False), (EXIT_PREFLIGHT, False),  # finished, or the pods must go
    (EXIT_CONFIG_ERROR, False), (EXIT_OOM, False),  # permanent by default
    (EXIT_WORKERS_STUCK, False),  # workers outlived their SIGKILL: the pods must go
])
def test_which_exit_codes_restart_in_place(code: int, in_place: bool) -> None:
    assert restart_policy.in_place(code, **DEFAULT) is in_place


def test_the_exit_code_lists_are_one_rule_for_both_kinds_of_restart() -> None:
    assert restart_policy.refusal(3, retryable=(), permanent=(3,)) == restart_policy.PERMANENT
    assert restart_policy.refusal(4, retryable=(3,), permanent=()) == restart_policy.NOT_RETRYABLE
    assert restart_policy.refusal(EXIT_PREEMPTED, retryable=(3,), permanent=(EXIT_PREEMPTED,)) is None
    assert not restart_policy.in_place(4, retryable=(3,), permanent=())
    assert restart_policy.in_place(3, retryable=(3,), permanent=())


def failed(node: int, round: int = 0, code: int = 1) -> Report:
    return Report(node, round, code, restart_policy.in_place(code, **DEFAULT))


def gang(nodes: int = 3, left: int = 2) -> Rounds:
    rounds = Rounds(nodes, left)
    for node in range(nodes):
        rounds.join(node)
    return rounds


def test_a_failure_aborts_the_round_and_every_nodes_report_starts_the_next() -> None:
    rounds = gang()
    assert rounds.report(failed(1, code=137)) == [Word(ABORT, 0, 1, 137)]
    assert rounds.report(Report(0, 0, None)) == []  # stopped for the abort
    # a peer's own failure (it lost its peer) is not the cause; the round goes on once all have said
    assert rounds.report(failed(2, code=1)) == [Word(GO, 1, 1, 137, left=1)]
    assert (rounds.round, rounds.left, rounds.reports, rounds.cause) == (1, 1, {}, None)
    assert rounds.report(failed(0, round=0)) == []  # the old round's word comes too late to count


def test_the_restart_names_the_node_that_says_why_it_failed() -> None:
    rounds = gang(nodes=2)
    assert rounds.report(failed(0)) == [Word(ABORT, 0, 0, 1)]  # a peer that lost its connection, first
    silent = Report(1, 0, 1, in_place=True, why="a worker ended without a word")
    assert rounds.report(silent) == [Word(GO, 1, 1, 1, "a worker ended without a word", left=1)]


def test_the_budget_ends_the_rounds_and_the_failure_is_the_nodes_to_exit_with() -> None:
    rounds = gang(nodes=2, left=1)
    rounds.report(failed(0))
    assert rounds.report(Report(1, 0, None)) == [Word(GO, 1, 0, 1, left=0)]
    assert rounds.report(failed(1, round=1, code=3)) == [Word(END, 1, 1, 3)]  # no restart left
    assert rounds.ended and rounds.report(failed(0, round=1)) == []


@pytest.mark.parametrize("code", [EXIT_CONFIG_ERROR, EXIT_PREEMPTED, EXIT_PREFLIGHT])
def test_a_failure_that_does_not_restart_in_place_ends_at_once_without_an_abort(code: int) -> None:
    # no abort: a preempted gang's peers are saving their checkpoint, they are not killed
    assert gang().report(failed(2, code=code)) == [Word(END, 0, 2, code)]


def test_a_node_whose_own_failure_needs_new_pods_during_an_abort_ends_the_rounds() -> None:
    rounds = gang(nodes=2)
    rounds.report(failed(0))
    assert rounds.report(failed(1, code=EXIT_CONFIG_ERROR)) == [Word(END, 0, 1, EXIT_CONFIG_ERROR)]


def test_a_finished_node_cannot_rejoin_so_a_later_failure_ends_the_rounds() -> None:
    rounds = gang(nodes=2)
    assert rounds.report(Report(0, 0, 0)) == []
    assert rounds.lost(0) == []  # a finished node goes quietly
    assert rounds.report(failed(1)) == [Word(END, 0, 1, 1)]
    # finishing while the others abort: the cause stays the failure
    rounds = gang(nodes=2)
    rounds.report(failed(1))
    assert rounds.report(Report(0, 0, 0)) == [Word(END, 0, 1, 1)]


def test_a_gang_not_all_joined_does_not_abort() -> None:
    rounds = Rounds(2, 1)
    rounds.join(0)
    assert rounds.report(failed(0)) == [Word(END, 0, 0, 1)]


def test_a_lost_node_or_one_that_does_not_report_in_time_ends_the_rounds() -> None:
    rounds = gang()
    assert rounds.lost(2) == [Word(END, 0, 2, None)]
    rounds = gang()
    rounds.report(failed(1))
    assert rounds.overdue() == [Word(END, 0, 1, 1)] and rounds.overdue() == []
    assert gang().overdue() == []  # nothing was aborted


STALL = "rank 0 completed no step for 95s"


def test_the_operators_ask_restarts_a_stalled_gang_in_place_without_spending_the_budget() -> None:
    rounds = gang(nodes=2, left=0)  # a disruption: even an empty budget restarts a stall in place
    assert rounds.ask(0, STALL) == [Word(ABORT, 0, OPERATOR, None, STALL)]
    assert rounds.ask(0, STALL) == []  # asked once
    assert rounds.report(Report(0, 0, None)) == []
    # a node that failed on its own meanwhile (it lost its peer) is not the cause: the operator's is
    assert rounds.report(Report(1, 0, 1, in_place=True, why="lost a peer")) == [
        Word(GO, 1, OPERATOR, None, STALL, left=0)]
    assert rounds.left == 0 and rounds.round == 1


@pytest.mark.parametrize("state", ["failure under way", "another round", "not all joined", "ended",
                                   "a node finished"])
def test_the_operators_ask_is_refused_where_a_round_cannot_begin(state: str) -> None:
    rounds = Rounds(2, 1) if state == "not all joined" else gang(nodes=2, left=1)
    if state == "not all joined":
        rounds.join(0)
    elif state == "failure under way":
        rounds.report(failed(1))
    elif state == "ended":
        rounds.lost(1)
    elif state == "a node finished":
        rounds.report(Report(1, 0, 0))
    asked = 1 if state == "another round" else 0
    assert rounds.ask(asked, STALL) == []
    assert rounds.left == 1 and (rounds.cause is None or rounds.cause.node != OPERATOR)


def test_an_asked_round_that_a_node_does_not_stop_for_ends_as_the_operators_stall() -> None:
    rounds = gang(nodes=2)
    rounds.ask(0, STALL)
    assert rounds.overdue() == [Word(END, 0, OPERATOR, None, STALL)]
    code, said = supervisor.last_word(supervisor.RoundEnd(None, TerminationMessage()),
                                      Word(END, 0, OPERATOR, None, STALL), None)
    # not the job's failure: the operator reads the reason as the stall it asked about (a disruption)
    assert code == 1 and said.reason == REASON_STALLED
    assert said.message is not None
    assert said.message.startswith(f"{STALL}; the gang was asked to restart in place")


ASKED = "a restart asked (tetrad.dev/restart-in-place='t1')"


def test_a_users_ask_saves_first_and_its_round_spends_nothing() -> None:
    rounds = gang(nodes=2, left=0)
    assert rounds.ask(0, ASKED, save=True) == [Word(ABORT, 0, OPERATOR, None, ASKED, save=True)]
    assert rounds.report(Report(0, 0, None)) == []
    assert rounds.report(Report(1, 0, None)) == [Word(GO, 1, OPERATOR, None, ASKED, left=0, save=True)]
    # the next round's failure is a plain one again: it neither saves nor is free
    rounds.left = 1
    assert rounds.report(failed(1, round=1)) == [Word(ABORT, 1, 1, 1)]
    assert rounds.report(Report(0, 1, None)) == [Word(GO, 2, 1, 1, left=0)]
    word = Word(GO, 1, OPERATOR, None, ASKED, left=0, save=True)
    assert supervisor.restarting(word, 0.0) == (
        f"{ASKED}: restarting the gang in place, round 1, in 0s (asked, saving first, spending no"
        " spec.runPolicy.maxRestarts)")


def test_an_asked_restart_that_a_node_does_not_stop_for_ends_with_the_reason_restart_asked() -> None:
    rounds = gang(nodes=2)
    rounds.ask(0, ASKED, save=True)
    [end] = rounds.overdue()
    assert end == Word(END, 0, OPERATOR, None, ASKED, save=True)
    code, said = supervisor.last_word(supervisor.RoundEnd(None, TerminationMessage()), end, None, 115.0)
    assert code == 1 and said.reason == REASON_RESTART_ASKED  # a disruption, as a stall's
    # the coordinator waited the stop timeout and the save's time
    assert said.message is not None and "a node did not stop within 205s or was lost" in said.message


@pytest.mark.parametrize(("save", "after"), [(False, (0.4, 2.0)), (True, (3.4, 6.0))])
def test_a_saving_round_gives_the_nodes_its_save_time_more_to_report(
        monkeypatch: pytest.MonkeyPatch, save: bool, after: tuple[float, float]) -> None:
    monkeypatch.setattr(rounds_module, "STOP_TIMEOUT_S", 0.5)
    port = free_port()
    coordinator = Coordinator(Rounds(1, 0), "job/0/t", "127.0.0.1", port, save_s=3.0)
    member = Member(0, "job/0/t", "127.0.0.1", port, connect_timeout_s=10)
    try:
        deadline = time.monotonic() + 10
        while coordinator.rounds.joined != {0} and time.monotonic() < deadline:
            time.sleep(0.01)
        asked = time.monotonic()
        assert rounds_module.ask("127.0.0.1", port, "job/0/t", 0, ASKED, save=save)
        with member.cond:
            assert member.cond.wait_for(lambda: member.aborted(0) is not None, timeout=10)
            assert member.words[(ABORT, 0)].save is save
            # nobody reports: the rounds end once the stop timeout, and the save's time, are over
            assert member.cond.wait_for(lambda: (END, 0) in member.words, timeout=10)
            assert member.words[(END, 0)].save is save
        assert after[0] <= time.monotonic() - asked <= after[1]
    finally:
        member.close()
        coordinator.close()


# a torchrun stand-in: says it is up, then on SIGTERM saves (a file) and exits 75, or ignores SIGTERM
CHILD = """
import pathlib, signal, sys, time
here = pathlib.Path(sys.argv[1])
def save(*_):
    (here / "saved").touch()
    sys.exit(75)
signal.signal(signal.SIGTERM, save if sys.argv[2] == "saves" else signal.SIG_IGN)
(here / "up").touch()
time.sleep(60)
"""


@pytest.mark.parametrize("child", ["saves", "ignores SIGTERM"])
def test_an_abort_that_saves_first_sigterms_the_round_and_sigkills_it_after_the_grace(
        tmp_path: Path, child: str) -> None:
    aborted: list[float] = []  # when the abort was first asked (the child's start-up is not timed)

    def abort(pid: int) -> float | None:
        if not (tmp_path / "up").exists():
            return None
        if not aborted:
            aborted.append(time.monotonic())
        return 2.0

    assert run_abortable([sys.executable, "-c", CHILD, str(tmp_path), child], None, abort) is None
    took = time.monotonic() - aborted[0]
    if child == "saves":
        assert (tmp_path / "saved").exists() and took < 2.0  # it exited by itself, in its grace
    else:
        assert not (tmp_path / "saved").exists() and 2.0 <= took < 10.0  # SIGKILLed once the grace ran out


def test_a_stop_signal_that_comes_while_a_round_is_aborted_is_the_callers_to_act_on(tmp_path: Path) -> None:
    """The supervisor's handler (BetweenRounds) gets a SIGTERM the kubelet sent during the abort, so the
    node stops rather than starting the next round."""
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))

    def abort(pid: int) -> float | None:
        if not (tmp_path / "up").exists():
            return None
        os.kill(os.getpid(), signal.SIGTERM)  # the pod is deleted as its round is aborted
        return 2.0

    try:
        assert run_abortable([sys.executable, "-c", CHILD, str(tmp_path), "saves"], None, abort) is None
        time.sleep(0.1)  # Python runs the handler between bytecodes
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (tmp_path / "saved").exists() and seen == [signal.SIGTERM]


def test_a_stop_signal_while_the_round_runs_reaches_it_once_and_then_the_caller(tmp_path: Path) -> None:
    """The pod is deleted (or a deadline passes) while torchrun runs: torchrun gets one SIGTERM, and the
    supervisor's own handler hears it after the round, so the node ends instead of going on to the next
    round. `run_forwarding` (a worker's command) only passes it on: its caller is the child's exit code."""
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))

    def stop_once_up(pid: int) -> float | None:
        if (tmp_path / "up").exists() and not (tmp_path / "asked").exists():
            (tmp_path / "asked").touch()
            os.kill(os.getpid(), signal.SIGTERM)
        return None

    try:
        assert run_abortable([sys.executable, "-c", CHILD, str(tmp_path), "saves"], None, stop_once_up) == 75
        time.sleep(0.1)  # Python runs the handler between bytecodes
        assert (tmp_path / "saved").exists() and seen == [signal.SIGTERM]
        for name in ("up", "saved"):
            (tmp_path / name).unlink()
        seen.clear()
        threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
        assert run_forwarding([sys.executable, "-c", CHILD, str(tmp_path), "saves"]) == 75
        time.sleep(0.1)
        assert (tmp_path / "saved").exists() and seen == []
    finally:
        signal.signal(signal.SIGTERM, previous)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_coordinator_and_its_members_over_tcp() -> None:
    port = free_port()
    coordinator = Coordinator(Rounds(2, 1), "job/0", "127.0.0.1", port)
    members = [Member(node, "job/0", "127.0.0.1", port, connect_timeout_s=10) for node in (0, 1)]
    stranger = Member(1, "another-job/0", "127.0.0.1", port, connect_timeout_s=10)
    try:
        stranger.connecting.join(10)
        with stranger.cond:  # another gang's member is turned away
            assert stranger.cond.wait_for(lambda: stranger.detached, timeout=10)
        deadline = time.monotonic() + 10
        while coordinator.rounds.joined != {0, 1} and time.monotonic() < deadline:  # both said hello
            time.sleep(0.01)
        assert members[1].report(Report(1, 0, 1, in_place=True))
        with members[0].cond:
            assert members[0].cond.wait_for(lambda: members[0].aborted(0), timeout=10)
        assert not members[0].aborted(1)
        assert members[0].report(Report(0, 0, None))
        assert [m.next_word(0, timeout_s=10) for m in members] == [Word(GO, 1, 1, 1, left=0)] * 2
        assert members[0].report(Report(0, 1, 1, in_place=True))  # no restart left
        assert [m.next_word(1, timeout_s=10) for m in members] == [Word(END, 1, 0, 1)] * 2
    finally:
        for m in members:
            m.close()
        coordinator.close()


def test_the_operator_asks_the_coordinator_over_tcp() -> None:
    port = free_port()
    coordinator = Coordinator(Rounds(2, 0), "job/0/t", "127.0.0.1", port)
    members = [Member(node, "job/0/t", "127.0.0.1", port, connect_timeout_s=10) for node in (0, 1)]
    try:
        deadline = time.monotonic() + 10
        while coordinator.rounds.joined != {0, 1} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not rounds_module.ask("127.0.0.1", port, "job/0/other", 0, STALL)  # not this gang's id
        assert not rounds_module.ask("127.0.0.1", free_port(), "job/0/t", 0, STALL)  # nobody listens
        assert coordinator.rounds.cause is None
        assert rounds_module.ask("127.0.0.1", port, "job/0/t", 0, STALL)
        assert not rounds_module.ask("127.0.0.1", port, "job/0/t", 0, STALL)  # the round is already aborted
        for m in members:
            with m.cond:
                assert m.cond.wait_for(lambda m=m: m.aborted(0), timeout=10)
            assert m.report(Report(m.node, 0, None))
        assert [m.next_word(0, timeout_s=10) for m in members] == [Word(GO, 1, OPERATOR, None, STALL, 0)] * 2
        assert supervisor.restarting(members[0].next_word(0) or Word(GO, 1), 0.0) == (
            f"{STALL}: restarting the gang in place, round 1, in 0s (a disruption, spending no"
            " spec.runPolicy.maxRestarts)")
    finally:
        for m in members:
            m.close()
        coordinator.close()


def test_a_member_that_loses_the_coordinator_is_on_its_own() -> None:
    port = free_port()
    coordinator = Coordinator(Rounds(2, 1), "job/0", "127.0.0.1", port)
    member = Member(1, "job/0", "127.0.0.1", port, connect_timeout_s=10)
    with member.cond:
        assert member.cond.wait_for(lambda: member.sock is not None, timeout=10)
    coordinator.close()
    assert member.next_word(0, timeout_s=10) is None  # the connection closed: no word will come
    nobody = Member(1, "job/0", "127.0.0.1", free_port(), connect_timeout_s=0.5)
    assert not nobody.report(Report(1, 0, 1, in_place=True))  # never connected: it exits as it would


def test_a_restart_in_place_waits_the_backoff_of_the_operators_restarts() -> None:
    assert [restart_policy.backoff_seconds(10, 25, r) for r in range(5)] == [0, 10, 20, 25, 25]


def test_the_settings_travel_in_one_variable() -> None:
    settings = RoundSettings("pod-0.job", 29501, 3, (1, 2), (77, 78), 10.0, 300.0, 2, "secret")
    env = NodeEnv.read({"TETRAD_ROUNDS": settings.encode(), "PET_NNODES": "4", "PET_RDZV_ID": "job-r0",
                        "TETRAD_ROUND": "2"})
    assert (env.rounds, env.nodes, env.rdzv_id, env.round) == (settings, 4, "job-r0", 2)
    assert NodeEnv.read({}).rounds is None


def test_a_stop_signal_the_caller_already_heard_starts_no_child(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    with pytest.raises(StopRequested) as stop:
        run_abortable(command, None, None, lambda: signal.SIGTERM)
    assert stop.value.signum == signal.SIGTERM and not marker.exists()


@pytest.mark.parametrize("rounds", [True, False], ids=["restarts-in-place", "no-rounds"])
def test_a_stop_signal_before_torchrun_starts_ends_the_node_without_starting_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rounds: bool) -> None:
    """A deadline 1 s into the run (or the pod deleted) finds the supervisor with its own handlers in place
    but torchrun not started: the node ends at once, rather than running a whole round first."""
    oom_kills = supervisor.oom_killer.oom_kills

    def sigterm_first() -> object:  # the round's first step, once the supervisor's handlers are in place
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # Python runs the handler between bytecodes
        return oom_kills()

    monkeypatch.setattr(supervisor.oom_killer, "oom_kills", sigterm_first)
    marker, termination = tmp_path / "ran", tmp_path / "termination"
    node_env = {"PET_NNODES": "1", "PET_NODE_RANK": "0", "TETRAD_TERMINATION_LOG": str(termination)}
    if rounds:
        settings = RoundSettings("127.0.0.1", free_port(), 3, (), (EXIT_OOM,), 0.0, 0.0, 0, "t")
        node_env |= {"TETRAD_ROUNDS": settings.encode(), "PET_RDZV_ID": "job", "TETRAD_SPARE": "0"}
    began = time.monotonic()
    code = supervisor.supervise([sys.executable, "-c", f"open({str(marker)!r}, 'w')"], NodeEnv.read(node_env))
    assert code == 128 + signal.SIGTERM and not marker.exists()
    assert time.monotonic() - began < 10
    said = TerminationMessage.parse(termination.read_text())
    assert said.message == "stopped by SIGTERM before round 0's workers started", said


class Aborting:
    """A member whose round is aborted at once, and that records its reports."""

    def __init__(self) -> None:
        self.reports: list[Report] = []

    def aborted(self, round: int) -> Word:
        return Word(ABORT, round, 1, 1)

    def report(self, report: Report) -> bool:
        self.reports.append(report)
        return True

    def next_word(self, round: int) -> Word:
        return Word(END, round, 0, EXIT_WORKERS_STUCK)


def test_workers_that_outlive_their_sigkill_end_the_rounds_so_the_gang_gets_new_pods(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "kill_all_with", lambda name, value, timeout_s: [4242])
    settings = RoundSettings("127.0.0.1", free_port(), 3, (), (EXIT_OOM,), 0.0, 0.0, 0, "t")
    env = NodeEnv.read({"TETRAD_ROUNDS": settings.encode(), "PET_NNODES": "2"})
    member = Aborting()
    ended = supervisor.run_round([sys.executable, "-c", "import time; time.sleep(60)"], env, 0, member)
    assert (ended.final, ended.message.reason) == (EXIT_WORKERS_STUCK, REASON_WORKERS_STUCK)
    assert ended.why is not None and "workers [4242] of round 0 are still there" in ended.why
    assert supervisor.next_word(member, env, 0, ended) == Word(END, 0, 0, EXIT_WORKERS_STUCK)
    assert member.reports == [Report(0, 0, EXIT_WORKERS_STUCK, in_place=False, why=ended.why)]


@contextlib.contextmanager
def node_0_failing_once_joined(tmp_path: Path, then: str = "", as_file: bool = False,
                               **node_env: str) -> Iterator[tuple[subprocess.Popen[str], Member]]:
    """Node 0's real supervisor, whose worker (its torchrun) exits 3 in round 0 once node 1 (a bare Member)
    joined and the test touched `tmp_path/go`, and runs `then` in later rounds; its termination message goes
    to `tmp_path/termination`. The worker is `python -c CODE`, or `python FILE` (`as_file`: one a spare can
    run)."""
    port = free_port()
    settings = RoundSettings("127.0.0.1", port, 3, (), (EXIT_OOM,), 0.0, 0.0, 0, "t")
    env = {**os.environ, "TETRAD_ROUNDS": settings.encode(), "PET_NNODES": "2", "PET_NODE_RANK": "0",
           "PET_RDZV_ID": "job", "TETRAD_TERMINATION_LOG": str(tmp_path / "termination"), **node_env}
    go = str(tmp_path / "go")
    worker = (f"import os, sys, time\nif os.environ['{ENV_ROUND}'] == '0':\n"
              f"    while not os.path.exists({go!r}): time.sleep(0.05)\n    sys.exit(3)\n{then}")
    (tmp_path / "worker.py").write_text(worker)
    command = [str(tmp_path / "worker.py")] if as_file else ["-c", worker]
    node0 = subprocess.Popen([sys.executable, "-m", "tetrad.node", "supervise", "--", sys.executable,
                              *command], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    node1 = Member(1, "job/0/t", "127.0.0.1", port, connect_timeout_s=120)
    try:
        with node1.cond:
            assert node1.cond.wait_for(lambda: node1.sock is not None, timeout=120), node0.poll()
        time.sleep(0.5)  # the coordinator has read its hello
        (tmp_path / "go").touch()
        with node1.cond:  # node 0 failed in place: the round is aborted, and node 0 waits for node 1
            assert node1.cond.wait_for(lambda: node1.aborted(0), timeout=60), node0.poll()
        yield node0, node1
    finally:
        node1.close()
        if node0.poll() is None:
            node0.kill()
        node0.wait()


def said(node: subprocess.Popen[str]) -> str:
    return node.stdout.read() if node.stdout else ""


def test_a_node_stopped_while_it_waits_between_rounds_exits_at_once_with_its_own_failure(
        tmp_path: Path) -> None:
    with node_0_failing_once_joined(tmp_path) as (node0, _):
        time.sleep(0.5)
        node0.send_signal(signal.SIGTERM)
        assert node0.wait(timeout=10) == 3, said(node0)
    termination = tmp_path / "termination"
    assert TerminationMessage.parse(termination.read_text() if termination.exists() else None) == \
        TerminationMessage()  # a failure without a stated cause: nothing to say, and nothing false said


def test_the_next_rounds_workers_learn_its_cause_and_the_node_says_its_last_round(tmp_path: Path) -> None:
    seen = tmp_path / "seen"  # in round 1, node 0's worker says what its environment holds
    then = (f"said = os.environ['{ENV_ROUND}'] + '|' + os.environ['{ENV_ROUND_CAUSE}']\n"
            f"open({str(seen)!r}, 'w').write(said)")
    with node_0_failing_once_joined(tmp_path, then) as (node0, node1):
        assert node1.report(Report(1, 0, None))  # node 1's workers are gone too
        assert node1.next_word(0) == Word(GO, 1, 0, 3, left=2)
        assert node0.wait(timeout=60) == 0, said(node0)
    assert seen.read_text() == "1|node 0 exited 3"
    assert TerminationMessage.parse((tmp_path / "termination").read_text()) == TerminationMessage(round=1), \
        "the operator counts the round even if no scrape saw it"


@pytest.mark.parametrize("spare", ["1", "0"])
def test_the_next_round_runs_forked_from_a_spare_that_imported_torch_unless_turned_off(
        tmp_path: Path, spare: str) -> None:
    seen = tmp_path / "seen"  # in round 1, node 0's worker says whether torch came with it, and its parent
    then = (f"parent = open(f'/proc/{{os.getppid()}}/cmdline').read().split(chr(0))\n"
            f"open({str(seen)!r}, 'w').write(repr(('torch' in sys.modules, parent)))")
    with node_0_failing_once_joined(tmp_path, then, as_file=True, TETRAD_SPARE=spare) as (node0, node1):
        assert node1.report(Report(1, 0, None))
        assert node1.next_word(0) == Word(GO, 1, 0, 3, left=2)
        assert node0.wait(timeout=120) == 0, said(node0)
    warm, parent = eval(seen.read_text())
    if spare == "1":  # forked from the spare: torch is there before the worker imports anything
        assert warm and "spare" in parent, parent
    else:
        assert not warm and "supervise" in parent, parent


def test_a_pod_without_room_for_a_spare_says_so_once_and_starts_its_next_round_cold(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(supervisor.oom_killer, "room_bytes", lambda: 300 << 20)
    spares = supervisor.Spares(True)
    spares.prepare()
    spares.prepare()
    assert spares.take() is None
    said = capsys.readouterr().err
    assert said.count("no spare interpreter for the next round: 0.3 GiB of memory left, it needs 1 GiB") == 1
    monkeypatch.setattr(supervisor.oom_killer, "room_bytes", lambda: 8 << 30)
    with supervisor.Spares(True) as roomy:
        roomy.prepare()
        assert roomy.next is not None and roomy.next.process.poll() is None
    assert roomy.next.process.poll() is not None, "the spare outlived its node's rounds"


def test_the_run_summary_names_each_restart_by_its_whole_cause() -> None:
    lines = [supervisor.restarting(Word(GO, 1, 1, 1, supervisor.SILENT_WORKER, left=2), 1.0),
             supervisor.restarting(Word(GO, 2, 0, 79, "a collective timed out: rank 0: gloo: x", left=1),
                                   2.0)]
    assert restarts_row(lines) == ("2 in place: node 1 exited 1 (a worker ended without a word: killed by a"
                                   " signal, or crashed); node 0 exited 79 (a collective timed out: rank 0:"
                                   " gloo: x)")


def torchrun_children(proc: Path, *pids: int) -> None:
    """A fake /proc where torchrun (pid 100) has the workers `pids`, each of rank pid - 200."""
    (proc / "100" / "task" / "100").mkdir(parents=True, exist_ok=True)
    (proc / "100" / "task" / "100" / "children").write_text(" ".join(map(str, pids)))
    for pid in pids:
        (proc / str(pid)).mkdir(exist_ok=True)
        (proc / str(pid) / "environ").write_bytes(f"A=1\0RANK={pid - 200}\0LOCAL_RANK=0\0".encode())


def test_the_first_failed_worker_is_one_that_ended_without_a_report_or_with_a_failing_code(
        tmp_path: Path) -> None:
    proc, exit_dir = tmp_path / "proc", tmp_path / "exit"
    exit_dir.mkdir()

    def workers(*pids: int) -> None:
        torchrun_children(proc, *pids)

    first = FirstFailure(exit_dir, proc)
    workers(200, 201, 202, 204)
    for rank in (0, 1, 2):  # the launcher runs ranks 0-2; rank 4 is a bare script
        (exit_dir / f"started-rank-{rank}").write_text("")
    assert first.check([100]) is None and first.ranks == {200: 0, 201: 1, 202: 2, 204: 4}
    (exit_dir / "rank-0").write_text("0")  # rank 0 finished
    workers(201, 202, 204)
    assert first.check([100]) is None
    (exit_dir / "rank-1").write_text(str(EXIT_PREEMPTED))  # rank 1 was preempted and saved
    workers(202)
    assert first.check([100]) is None, "a bare script says nothing when it ends: only its code would tell"
    workers()
    assert first.check([100]) == "rank 2's worker ended without a word"
    again = FirstFailure(exit_dir, proc)
    workers(203)
    assert again.check([100]) is None
    (exit_dir / "rank-3").write_text("77")
    workers()
    assert again.check([100]) == "rank 3's worker exited 77"


def test_a_collective_timeout_stops_the_round_once_its_peers_reported_or_after_a_grace(
        tmp_path: Path) -> None:
    """The node's other workers in the timed-out collective time out moments later and report the peers
    that did not answer: the round is not stopped under them (CI: a peer SIGKILLed before its report)."""
    proc, exit_dir = tmp_path / "proc", tmp_path / "exit"
    exit_dir.mkdir()
    now = [0.0]

    def workers(*pids: int) -> None:
        torchrun_children(proc, *pids)
        for pid in pids:  # each runs under the launcher
            (exit_dir / f"started-rank-{pid - 200}").write_text("")

    first = FirstFailure(exit_dir, proc, clock=lambda: now[0])
    workers(202, 203)
    assert first.check([100]) is None
    (exit_dir / "rank-3").write_text(str(EXIT_COLLECTIVE_TIMEOUT))
    workers(202)
    assert first.check([100]) is None, "rank 2 is timing out in the same collective"
    now[0] = 1.0
    (exit_dir / "rank-2").write_text(str(EXIT_COLLECTIVE_TIMEOUT))
    workers()
    assert first.check([100]) == "rank 3's worker exited 79"  # every worker reported: at once
    late = FirstFailure(exit_dir, proc, clock=lambda: now[0])
    workers(204, 205)
    assert late.check([100]) is None
    (exit_dir / "rank-4").write_text(str(EXIT_COLLECTIVE_TIMEOUT))
    workers(205)  # rank 5 waits in another collective, with a later timeout
    assert late.check([100]) is None
    now[0] += COLLECTIVE_TIMEOUT_GRACE_S - 0.1
    assert late.check([100]) is None
    now[0] += 0.1
    assert late.check([100]) == "rank 4's worker exited 79"


def one_node_of_two_workers(tmp_path: Path, script: str) -> subprocess.CompletedProcess[str]:
    """A real supervisor (restarts in place on, 3 left) around a real torchrun whose two workers run
    `script` through the launcher, to its end."""
    (tmp_path / "worker.py").write_text(script)
    settings = RoundSettings("127.0.0.1", free_port(), 3, (), (EXIT_OOM,), 0.0, 0.0, 0, "t")
    env = {**os.environ, "TETRAD_ROUNDS": settings.encode(), "PET_NNODES": "1", "PET_NODE_RANK": "0",
           "PET_NPROC_PER_NODE": "2", "PET_RDZV_ID": "job"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
                "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "tetrad.node", "worker",
                "--path", str(tmp_path / "worker.py")]
    return subprocess.run([sys.executable, "-m", "tetrad.node", "supervise", "--", *torchrun],
                          env=env, capture_output=True, text=True, timeout=180)


WORKER_0_KILLED = """\
import os, signal, time
here, round = os.path.dirname(os.path.abspath(__file__)), os.environ["TETRAD_ROUND"]


def stamp(name):
    with open(os.path.join(here, name + ".tmp"), "w") as f:
        f.write(repr(time.time()))
    os.replace(os.path.join(here, name + ".tmp"), os.path.join(here, name))


if round in ("0", "1"):  # round 1's workers are forked from the spare
    if os.environ["RANK"] == "0":
        time.sleep(2)
        stamp("died-" + round)
        os.kill(os.getpid(), signal.SIGKILL)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stuck, as in a collective with a live peer
    for _ in range(1200):
        stamp("alive-" + round)  # its last stamp is when it was killed, to a tenth of a second
        time.sleep(0.1)
"""


def test_a_dead_worker_stops_its_stuck_peers_at_once_rather_than_after_torchruns_30_s(tmp_path: Path) -> None:
    """Rank 0 dies in rounds 0 (cold) and 1 (forked from the spare) while rank 1 is stuck; round 2 ends."""
    node = one_node_of_two_workers(tmp_path, WORKER_0_KILLED)
    assert node.returncode == 0, node.stderr[-3000:]
    said = node.stderr
    stopping = "rank 0's worker ended without a word: stopping the round's other workers at once"
    assert said.count(stopping) == 2, said
    for round in (1, 2):
        restarting = f"{rounds_module.RESTARTING}, round {round}"
        assert f"a worker ended without a word: killed by a signal, or crashed): {restarting}" in said, said
    assert said.count(READY) == 2, said[-3000:]
    for round in ("0", "1"):
        stamp = {name: float((tmp_path / f"{name}-{round}").read_text()) for name in ("died", "alive")}
        outlived = stamp["alive"] - stamp["died"]
        assert outlived < 10, f"round {round}: the stuck peer outlived the dead worker by {outlived:.1f}s " \
                              "(torchrun's own stop waits 30 s)"


WORKER_1_EXITS_AT_ONCE = """\
import os, sys, time
if os.environ["RANK"] == "1":
    os._exit(0)  # done, skipping its teardown
time.sleep(3)
"""


def test_a_worker_that_ends_with_os_exit_0_is_not_a_failure(tmp_path: Path) -> None:
    node = one_node_of_two_workers(tmp_path, WORKER_1_EXITS_AT_ONCE)
    assert node.returncode == 0, node.stderr[-3000:]
    assert "ended without a word" not in node.stderr and rounds_module.RESTARTING not in node.stderr, \
        node.stderr[-3000:]
