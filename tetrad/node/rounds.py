"""Restarts in place: a failed worker restarts every node's workers in the same pods, as one gang.

Each node's supervisor runs torchrun once per round. Node 0's supervisor also runs the coordinator, which
every supervisor (node 0's too) joins over TCP. When a node's torchrun ends with a code that restarts in
place (tetrad.api.restart_policy.in_place) and the budget has a restart left, the coordinator tells every
node to abort the round: each kills its torchrun and waits until none of its workers is left, then
reports. Once every node has reported it tells them all to go on to the next round: a new torchrun, a new
rendezvous, the workers resuming from the last checkpoint. So the processes of two rounds never run at
once, and the gang restarts whole, as the operator's restarts do.

The operator may ask for a round too (`ask`), when no failure is under way: a gang it saw stall (rank 0
completing no step) is restarted in place the same way; a restart a user asked for (the
tetrad.dev/restart-in-place annotation) `save`s first: each node stops its workers with SIGTERM, on which
they save a checkpoint and exit, as at a preemption, and is given its torchrun's shutdown timeout more to
report. Such a round is not the job's failure: it spends nothing of the budget, and its cause is the
operator's words (the operator counts it by them).

Anything else ends the rounds, and each node exits as it would without them: a code that does not restart
in place (a preemption, a config error, a permanent code), an empty budget, a node that finished, a node
that was lost (its connection closed) or that did not report within STOP_TIMEOUT_S. A node that cannot
reach the coordinator is on its own from then on: it exits when its torchrun does.

`Rounds` is the coordinator's decision as pure state; `Coordinator` and `Member` carry it over sockets as
JSON lines.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

ABORT, GO, END = "abort", "go", "end"
ASK_RESTART = "restart"  # what the operator asks of the coordinator
OPERATOR = -1  # the node of a cause from outside the gang: the operator's ask
RESTARTING = "restarting the gang in place"  # what a node's log says at each GO
STOP_TIMEOUT_S = 90.0  # after an abort, how long the coordinator waits for every node's report
CONNECT_RETRY_S = 0.2
REPORT_WAIT_S = 10.0  # a report waits this long for a connection still being made


@dataclass(frozen=True)
class Report:
    """How a node's round ended: its exit code, or None when it stopped for an abort."""

    node: int
    round: int
    code: int | None
    in_place: bool = False  # the code restarts in place
    why: str | None = None  # the cause in words, when the node knows it


@dataclass(frozen=True)
class Word:
    """What the coordinator tells every node: ABORT round `round`, GO on to round `round`, or END the
    rounds in round `round`; `node` and `code` say whose failure it is about (node OPERATOR: the operator's
    ask), `left` the restarts in place the budget has left."""

    kind: str
    round: int
    node: int | None = None
    code: int | None = None
    why: str | None = None
    left: int | None = None
    save: bool = False  # the operator's ask: the workers stop with SIGTERM and save first


@dataclass
class Rounds:
    """The coordinator's state: what a report, a lost node or the stop timeout makes it tell every node."""

    nodes: int
    left: int  # restarts in place left in the budget
    round: int = 0
    joined: set[int] = field(default_factory=set)
    reports: dict[int, Report] = field(default_factory=dict)  # this round's
    cause: Report | None = None  # the failure that aborted this round
    save: bool = False  # the operator's ask that aborted it saves first
    ended: bool = False

    def join(self, node: int) -> None:
        self.joined.add(node)

    def report(self, report: Report) -> list[Word]:
        if self.ended or report.round != self.round:
            return []
        self.reports[report.node] = report
        if self.cause is None:
            if not report.code:  # finished (it has left), or stopped without an abort: nothing to do yet
                return []
            if not (report.in_place and self.left > 0 and len(self.joined) == self.nodes
                    and all(r.code != 0 for r in self.reports.values())):
                return self._end(report)
            self.cause = report
            return [Word(ABORT, self.round, report.node, report.code, report.why), *self._barrier()]
        return self._barrier()

    def ask(self, round: int, why: str, save: bool = False) -> list[Word]:
        """The operator asks to restart `round` in place (the gang stalled, or a user asked, to `save`
        first): as a node's failure that restarts in place would, when every node has joined and none has
        reported; otherwise nothing (refused)."""
        if (self.ended or round != self.round or self.cause is not None or self.reports
                or len(self.joined) < self.nodes):
            return []
        self.cause, self.save = Report(OPERATOR, round, None, True, why), save
        return [Word(ABORT, self.round, OPERATOR, None, why, save=save)]

    def lost(self, node: int) -> list[Word]:
        """A node's connection closed: its supervisor is gone (a finished node's goes quietly)."""
        said = self.reports.get(node)
        if self.ended or (said is not None and said.code == 0):
            return []
        return self._end(self.cause or Report(node, self.round, None))

    def overdue(self) -> list[Word]:
        """STOP_TIMEOUT_S passed since the abort without every node's report."""
        return self._end(self.cause) if self.cause is not None and not self.ended else []

    def _barrier(self) -> list[Word]:
        if len(self.reports) < self.nodes:
            return []
        assert self.cause is not None
        ended = [r for r in self.reports.values() if r.code is not None]
        if not all(r.in_place for r in ended):  # a node finished, or failed in a way that needs more
            return self._end(next((r for r in ended if not r.in_place and r.code), self.cause))
        cause = self.cause
        if cause.node != OPERATOR:  # the operator's ask is a disruption: it spends nothing of the budget
            self.left -= 1
            # the cause to name: a node that knows why it failed before the first to report (often a peer
            # that only lost its connection to it)
            cause = next((r for r in ended if r.why), cause)
        save = self.save and cause.node == OPERATOR
        self.round += 1
        self.reports, self.cause, self.save = {}, None, False
        return [Word(GO, self.round, cause.node, cause.code, cause.why, self.left, save)]

    def _end(self, report: Report) -> list[Word]:
        self.ended = True
        return [Word(END, self.round, report.node, report.code, report.why,
                     save=self.save and report.node == OPERATOR)]


def stop_timeout(word: Word, save_s: float) -> float:
    """How long after `word` aborted a round every node must have reported: STOP_TIMEOUT_S, and `save_s`
    more when the abort saves first."""
    return STOP_TIMEOUT_S + (save_s if word.save else 0.0)


def _send(sock: socket.socket, doc: dict[str, Any]) -> bool:
    try:
        sock.sendall(json.dumps(doc).encode() + b"\n")
        return True
    except OSError:
        return False


def _hang_up(sock: socket.socket) -> None:
    """Close a connection another thread may be reading (a plain close waits for its reader's file)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def _lines(sock: socket.socket) -> Iterator[dict[str, Any]]:
    """The JSON objects a peer sends, until it closes the connection."""
    with contextlib.suppress(OSError), sock.makefile("rb") as lines:
        for line in lines:
            with contextlib.suppress(ValueError):
                if isinstance(doc := json.loads(line), dict):
                    yield doc


class Coordinator:
    """Node 0's: `Rounds` over TCP. Members say {"hello": node, "gang": id}, then their reports. The gang's
    id (its rendezvous, restart and a token only its pods have) turns away anyone else's. After an abort
    every node must report within STOP_TIMEOUT_S, and `save_s` more when the abort saves first."""

    def __init__(self, rounds: Rounds, gang: str, host: str, port: int, save_s: float = 0.0):
        self.rounds, self.gang, self.save_s = rounds, gang, save_s
        self.lock = threading.Lock()
        self.members: dict[int, socket.socket] = {}
        self.connections: set[socket.socket] = set()  # accepted, joined or not
        self.overdue_at: float | None = None  # when the nodes' reports of an abort are overdue
        self.server = socket.create_server((host, port), reuse_port=False)
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="rounds-accept").start()
        threading.Thread(target=self._watch, daemon=True, name="rounds-timeout").start()

    def close(self) -> None:
        self.closed.set()
        with contextlib.suppress(OSError):
            self.server.close()
        with self.lock:
            for sock in self.connections:
                _hang_up(sock)

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                sock, _ = self.server.accept()
            except OSError:
                return
            with self.lock:
                if self.closed.is_set():
                    _hang_up(sock)
                    return
                self.connections.add(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True, name="rounds-member").start()

    def _serve(self, sock: socket.socket) -> None:
        node = None
        for doc in _lines(sock):
            if node is None:
                if doc.get("gang") != self.gang:
                    break  # another gang's (an older incarnation's) member, or not one at all
                if doc.get("ask") == ASK_RESTART:
                    self._answer(sock, doc)
                    break
                if not isinstance(doc.get("hello"), int):
                    break
                node = doc["hello"]
                with self.lock:
                    self.members[node] = sock
                    self.rounds.join(node)
                continue
            try:
                code = None if doc.get("code") is None else int(doc["code"])
                why = str(doc["why"]) if doc.get("why") else None
                report = Report(node, int(doc["round"]), code, bool(doc.get("inPlace")), why)
            except (KeyError, TypeError, ValueError):
                continue
            with self.lock:
                self._tell(self.rounds.report(report))
        with self.lock:
            if node is not None and self.members.get(node) is sock:
                del self.members[node]
                if not self.closed.is_set():
                    self._tell(self.rounds.lost(node))
            self.connections.discard(sock)
        _hang_up(sock)

    def _answer(self, sock: socket.socket, doc: dict[str, Any]) -> None:
        """The operator's ask, {"ask": "restart", "gang": id, "round": r, "why": text, "save": bool}:
        {"accepted": bool}."""
        try:
            round, why = int(doc["round"]), str(doc.get("why") or "the operator asked")
        except (KeyError, TypeError, ValueError):
            words = []
        else:
            with self.lock:
                words = self.rounds.ask(round, why, doc.get("save") is True)
                self._tell(words)
        _send(sock, {"accepted": bool(words)})

    def _watch(self) -> None:
        while not self.closed.wait(0.5):
            with self.lock:
                if self.overdue_at is not None and time.monotonic() > self.overdue_at:
                    self._tell(self.rounds.overdue())

    def _tell(self, words: list[Word]) -> None:
        """Send `words` to every member (under the lock)."""
        for word in words:
            self.overdue_at = (time.monotonic() + stop_timeout(word, self.save_s) if word.kind == ABORT
                               else None)
            for sock in list(self.members.values()):
                _send(sock, asdict(word))


class Member:
    """A node's link to the coordinator: it connects in the background (node 0's supervisor may start
    later), hears the words, and sends this node's reports."""

    def __init__(self, node: int, gang: str, host: str, port: int, connect_timeout_s: float):
        self.node, self.gang = node, gang
        self.cond = threading.Condition()
        self.words: dict[tuple[str, int], Word] = {}
        self.sock: socket.socket | None = None
        self.detached = False  # never connected, or the connection closed: on its own
        self.connecting = threading.Thread(target=self._connect, args=(host, port, connect_timeout_s),
                                           daemon=True, name="rounds-connect")
        self.connecting.start()

    def _connect(self, host: str, port: int, timeout_s: float) -> None:
        give_up = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=5)
                sock.settimeout(None)
                break
            except OSError:
                if time.monotonic() > give_up:
                    self._detach()
                    return
                time.sleep(CONNECT_RETRY_S)
        if not _send(sock, {"hello": self.node, "gang": self.gang}):
            self._detach()
            return
        with self.cond:
            self.sock = sock
            self.cond.notify_all()
        for doc in _lines(sock):
            with contextlib.suppress(TypeError, ValueError):
                word = Word(str(doc["kind"]), int(doc["round"]), doc.get("node"), doc.get("code"),
                            doc.get("why"), doc.get("left"), doc.get("save") is True)
                with self.cond:
                    self.words[(word.kind, word.round)] = word
                    self.cond.notify_all()
        self._detach()

    def _detach(self) -> None:
        with self.cond:
            self.detached = True
            self.cond.notify_all()

    def aborted(self, round: int) -> Word | None:
        """The word that aborted `round`, if one did."""
        with self.cond:
            return self.words.get((ABORT, round))

    def report(self, report: Report) -> bool:
        """Send this node's report; False when it is on its own (not connected within REPORT_WAIT_S)."""
        with self.cond:
            self.cond.wait_for(lambda: self.sock is not None or self.detached, timeout=REPORT_WAIT_S)
            sock = None if self.detached else self.sock
        return sock is not None and _send(sock, {"round": report.round, "code": report.code,
                                                 "inPlace": report.in_place, "why": report.why})

    def next_word(self, round: int, timeout_s: float = STOP_TIMEOUT_S + 30) -> Word | None:
        """After this node's report of `round`: GO on to the next round or END; None when it is on its own
        (the coordinator is gone) or no word came in time."""
        def said() -> Word | None:
            return self.words.get((GO, round + 1)) or self.words.get((END, round))
        with self.cond:
            self.cond.wait_for(lambda: said() is not None or self.detached, timeout=timeout_s)
            return said()

    def close(self) -> None:
        with self.cond:
            sock, self.detached = self.sock, True
        if sock is not None:
            _hang_up(sock)


def token(rdzv_id: str) -> str:
    """What only an incarnation's pods (and the operator) know of its gang: from its rendezvous id."""
    return hashlib.sha256(rdzv_id.encode()).hexdigest()[:16]


def gang_id(rdzv_id: str, restart: int, secret: str) -> str:
    """The id a member or an ask must give the coordinator."""
    return f"{rdzv_id}/{restart}/{secret}"


def ask(host: str, port: int, gang: str, round: int, why: str, save: bool = False,
        timeout_s: float = 5.0) -> bool:
    """Ask node 0's coordinator to restart `round` in place, the workers saving first if `save`; whether
    it accepted."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            if not _send(sock, {"ask": ASK_RESTART, "gang": gang, "round": round, "why": why, "save": save}):
                return False
            return any(bool(doc.get("accepted")) for doc in _lines(sock))
    except OSError:
        return False
