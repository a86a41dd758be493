"""A worker node waits for pod 0's name inside its supervisor, before torchrun: the real resolver,
the real `python -m tetrad.node supervise`. A name that never resolves exits 69 (the preflight gate's
code: a disruption for the operator, tests/operator/test_preflight.py) naming the node."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tetrad.api.contract import ENV_NODE_NAME, ENV_RDZV_TIMEOUT, ENV_TERMINATION_LOG, EXIT_PREFLIGHT
from tetrad.api.termination import NodeFailure, TerminationMessage, blames_the_node
from tetrad.node import rendezvous
from tetrad.node.environment import NodeEnv


def wait_for_master(env: dict[str, str], retry_s: float = rendezvous.RESOLVE_RETRY_S) -> NodeFailure | None:
    return rendezvous.wait_for_master(NodeEnv.read(env), retry_s)

NOWHERE = "pod-0.no-such-service.invalid"  # .invalid never resolves (RFC 2606)


def test_rank_0_and_a_node_without_a_master_do_not_wait(capsys: pytest.CaptureFixture[str]) -> None:
    assert wait_for_master({"PET_MASTER_ADDR": NOWHERE, "PET_NODE_RANK": "0", ENV_RDZV_TIMEOUT: "60"}) is None
    assert wait_for_master({}) is None
    assert wait_for_master({"PET_MASTER_ADDR": "localhost", "PET_NODE_RANK": "1"}) is None
    assert capsys.readouterr().out == "", "a name that resolves at once is not announced"


def test_a_worker_goes_on_once_the_name_resolves(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    real, calls = socket.getaddrinfo, []

    def late_dns(host: str, *args: object) -> object:  # pod 0's record appears on the third lookup
        calls.append(host)
        if len(calls) < 3:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real("localhost", *args)

    monkeypatch.setattr(socket, "getaddrinfo", late_dns)
    env = {"PET_MASTER_ADDR": "j-0.j.ns.svc", "PET_NODE_RANK": "2", ENV_RDZV_TIMEOUT: "30"}
    assert wait_for_master(env, retry_s=0.05) is None
    assert calls == ["j-0.j.ns.svc"] * 3
    out = capsys.readouterr().out
    assert "waiting up to 30 s for pod 0's name j-0.j.ns.svc" in out and "j-0.j.ns.svc resolves" in out


def test_a_worker_whose_master_never_resolves_exits_69_naming_itself_without_starting_torchrun(
        tmp_path: Path) -> None:
    started, log = tmp_path / "started", tmp_path / "termination-log"
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "tetrad.node", "supervise", "--", "touch", str(started)],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PET_MASTER_ADDR": NOWHERE, "PET_NODE_RANK": "1",
                            ENV_RDZV_TIMEOUT: "2", ENV_NODE_NAME: "node-w", ENV_TERMINATION_LOG: str(log)})
    assert r.returncode == EXIT_PREFLIGHT, r.stderr
    assert not started.exists(), "torchrun must not start before pod 0's name resolves"
    assert time.monotonic() - t >= 2, "it waited the rendezvous timeout"
    assert f"pod 0's name {NOWHERE} did not resolve within 2 s" in r.stderr
    (failure,) = TerminationMessage.parse(log.read_text()).preflight
    assert (failure.node, failure.node_rank) == ("node-w", 1)
    assert failure.reason.startswith(f"rendezvous: pod 0's name {NOWHERE} did not resolve within 2 s")
    assert not blames_the_node(failure.reason), "the operator must not exclude the node for it"
    ok = subprocess.run([sys.executable, "-m", "tetrad.node", "supervise", "--", "touch", str(started)],
                        capture_output=True, text=True, timeout=60,
                        env={**os.environ, "PET_MASTER_ADDR": "localhost", "PET_NODE_RANK": "1",
                             ENV_RDZV_TIMEOUT: "2"})
    assert ok.returncode == 0 and started.exists(), ok.stderr


def test_the_preflight_gate_and_the_wait_share_one_resolver() -> None:
    from tetrad.node import checks

    assert checks.resolves is rendezvous.resolves
