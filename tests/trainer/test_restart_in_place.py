"""Restarts in place under `tetrad run`: real supervisors, torchrun agents and trainers on this machine.
A worker SIGKILLed mid-run restarts every node's workers as one gang, which resumes from the last
checkpoint and computes the same losses as a run nobody disturbed; so does a restart asked of node 0's
coordinator as the operator asks it for a tetrad.dev/restart-in-place token, where every worker saves
first and no step is trained twice."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from tests.processes import processes_mentioning
from tests.trainer.test_launch import make_job
from tetrad.api import ParallelTrainingJob
from tetrad.api.contract import ENV_TEST_FAULT, ENV_TEST_FAULTS_ALLOWED, EXIT_COLLECTIVE_TIMEOUT
from tetrad.launch import run_local
from tetrad.launch.local import kill_rank_at, logged_steps, run_processes
from tetrad.node import rounds, spare
from tetrad.node.environment import NodeEnv

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, KILL_AT = 16, 8  # checkpoints every 5 steps: the restart resumes at 5 and recomputes 6-8


def losses(jsonl: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, jsonl.read_text().splitlines())]


def kill_rank_in_background(workdir: Path, jsonl: Path, rank: int, step: int,
                            killed: list[int]) -> threading.Thread:
    """kill_rank_at while the run goes on in the foreground; the pids it killed land in `killed`."""
    thread = threading.Thread(target=lambda: killed.extend(kill_rank_at(workdir, jsonl, rank, step)),
                              daemon=True)
    thread.start()
    return thread


def job(tmp_path: Path, max_restarts: int) -> ParallelTrainingJob:
    return make_job("in-place", checkpoint={"enabled": True, "path": str(tmp_path / "ckpt"), "interval": 5},
                    runPolicy={"maxRestarts": max_restarts, "backoffSeconds": 1})


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The losses of a run nobody disturbed, by step."""
    undisturbed = tmp_path_factory.mktemp("undisturbed")
    assert run_local(job(undisturbed, 1), steps=STEPS, jsonl=undisturbed / "out.jsonl",
                     workdir=undisturbed / "work") == 0
    return dict(losses(undisturbed / "out.jsonl"))


def test_a_killed_worker_restarts_the_gang_in_place_and_the_losses_equal_an_undisturbed_run(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], expected: dict[int, float]) -> None:
    work, jsonl, killed = tmp_path / "work", tmp_path / "out.jsonl", []
    watcher = kill_rank_in_background(work, jsonl, rank=1, step=KILL_AT, killed=killed)
    code = run_local(job(tmp_path, 1), steps=STEPS, jsonl=jsonl, workdir=work)
    watcher.join()
    assert code == 0, (work / "node-0.log").read_text()[-3000:]
    assert killed, "the worker of rank 1 was never found"
    seen = losses(jsonl)
    steps = [s for s, _ in seen]
    # the gang went back to the checkpoint at step 5 and trained on from there, every step once more
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert steps[restart] == 6 and steps[restart:] == list(range(6, STEPS + 1))
    assert steps[:restart] == list(range(1, steps[restart - 1] + 1)) and steps[restart - 1] >= KILL_AT
    # every loss, the recomputed steps' included, is the undisturbed run's
    for step, loss in seen:
        assert loss == pytest.approx(expected[step], rel=1e-6, abs=1e-6), step
    said = capfd.readouterr().err
    # after runPolicy.backoffSeconds, as the operator's restarts wait
    assert ("node 1 exited 1 (a worker ended without a word: killed by a signal, or crashed): restarting the"
            " gang in place, round 1, in 1s (spec.runPolicy.maxRestarts: 0 left)") in said
    assert "restarts" in said and "1 in place" in said  # the summary
    for node in (0, 1):  # both supervisors took part in the one restart, its round forked from their spares
        log = (work / f"node-{node}.log").read_text()
        assert "restarting the gang in place, round 1" in log
        assert log.count(spare.READY) == 1 and "no spare interpreter" not in log, log[-3000:]
    assert not processes_mentioning(str(work))


def test_without_a_restart_left_a_killed_worker_fails_the_run_as_before(tmp_path: Path) -> None:
    work, jsonl, killed = tmp_path / "work", tmp_path / "out.jsonl", []
    watcher = kill_rank_in_background(work, jsonl, rank=1, step=3, killed=killed)
    code = run_local(job(tmp_path, 0), steps=STEPS, jsonl=jsonl, workdir=work)
    watcher.join()
    assert killed and code not in (0, None)
    assert max(s for s, _ in losses(jsonl)) < STEPS
    assert "restarting the gang in place" not in (work / "node-0.log").read_text()
    assert not processes_mentioning(str(work))


def test_a_hung_collective_restarts_the_gang_in_place_and_the_run_completes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # rank 1 hangs at step 3 (a test fault acts in the first round only): its peers time out and exit 79
    monkeypatch.setenv(ENV_TEST_FAULT, "hang-rank:1:step:3")
    monkeypatch.setenv(ENV_TEST_FAULTS_ALLOWED, "1")
    work, jsonl = tmp_path / "work", tmp_path / "out.jsonl"
    hung = make_job("hung", checkpoint={"enabled": True, "path": str(tmp_path / "ckpt"), "interval": 2},
                    runPolicy={"maxRestarts": 1, "backoffSeconds": 0, "collectiveTimeoutSeconds": 10})
    assert run_local(hung, steps=6, jsonl=jsonl, workdir=work) == 0, (work / "node-0.log").read_text()[-3000:]
    assert [s for s, _ in losses(jsonl)] == [1, 2, 3, 4, 5, 6]  # resumed from step 2, where rank 1 hung
    node0 = (work / "node-0.log").read_text()
    assert '"collective_timeout"' in node0
    assert f"node 0 exited {EXIT_COLLECTIVE_TIMEOUT} (a collective timed out: rank 0:" in node0
    assert "not answering: rank 1): restarting the gang in place, round 1" in node0
    assert "test faults act in the first round of restarts in place only" in node0
    assert not processes_mentioning(str(work))


def ask_restart_at(workdir: Path, jsonl: Path, step: int, answers: list[bool]) -> threading.Thread:
    """Once rank 0 has logged `step`, ask node 0's coordinator to restart round 0 in place, saving first,
    with the address and gang id the nodes' environment gives (as the operator derives them)."""
    def watch() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            time.sleep(0.05)
            if max(logged_steps(jsonl), default=0) >= step:
                pid = run_processes(workdir)[0]
                env = NodeEnv.read(dict(line.split("=", 1) for line in
                                        Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in line))
                settings = env.rounds
                assert settings is not None
                gang = rounds.gang_id(env.rdzv_id, env.restart, settings.token)
                answers.append(rounds.ask(settings.host, settings.port, gang, 0, ASKED, save=True))
                return
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


ASKED = "a restart asked (tetrad.dev/restart-in-place='now')"


def test_an_asked_restart_saves_first_and_the_gang_trains_every_step_once_to_the_same_losses(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], expected: dict[int, float]) -> None:
    work, jsonl, answers = tmp_path / "work", tmp_path / "out.jsonl", []
    asker = ask_restart_at(work, jsonl, step=KILL_AT, answers=answers)
    # maxRestarts 0: the asked round spends nothing
    code = run_local(job(tmp_path, 0), steps=STEPS, jsonl=jsonl, workdir=work)
    asker.join()
    assert code == 0, (work / "node-0.log").read_text()[-3000:]
    assert answers == [True]
    seen = losses(jsonl)
    # every step once: the workers saved the step they stopped after, and round 1 resumed from it
    assert [s for s, _ in seen] == list(range(1, STEPS + 1))
    for step, loss in seen:
        assert loss == pytest.approx(expected[step], rel=1e-6, abs=1e-6), step
    node0 = (work / "node-0.log").read_text()
    stopped = next(int(m) for m in re.findall(r"stopped after step (\d+) on SIGTERM", node0))
    assert KILL_AT <= stopped < STEPS
    assert f"checkpoint: resumed step {stopped} from" in node0
    for node in (0, 1):
        assert (f"{ASKED}: restarting the gang in place, round 1, in 1s (asked, saving first, spending no"
                " spec.runPolicy.maxRestarts)") in (work / f"node-{node}.log").read_text()
    assert "1 in place" in capfd.readouterr().err  # the summary
    assert not processes_mentioning(str(work))
