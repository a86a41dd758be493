"""Kill tests: SIGKILL a rank inside every commit phase and at random moments of saving and of
training, then resume; SIGTERM a rank and expect every rank to save and exit 75. Each time the
resumed run must end exactly where the straight run ends (same losses, same parameters)."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from tests.checkpoint import gang, toy
from tests.checkpoint.conftest import LAYOUTS, assert_same_run, run_toy
from tetrad.api.contract import EXIT_PREEMPTED

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYOUT = "dps2"


def finish_and_compare(path: Path, a: list[dict], **spec) -> dict:
    """Resume (if there is anything to resume) and train to step 10; compare with the straight run."""
    b = run_toy(LAYOUT, path, steps=10, **spec)
    start = b[0]["resumed"]["step"] if b[0]["resumed"] else 0
    assert sorted(b[0]["losses"]) == list(range(start + 1, 11))
    assert_same_run(b[0], a[0], range(start + 1, 11))
    return b[0]


# Phases of a save, in order, and the rank that passes through each (the commit is rank 0's).
PHASES = [("staged", 1), ("dcp-written", 1), ("rank-file-written", 1), ("manifest-written", 0),
          ("renamed", 0), ("published", 0), ("pruned", 0)]


# Only asynchronous saves stage a copy, so the sync mode has no "staged" phase.
KILLS = [(phase, rank, async_save) for async_save in (False, True) for phase, rank in PHASES
         if async_save or phase != "staged"]


@pytest.mark.parametrize(("phase", "rank", "async_save"), KILLS,
                         ids=[f"{p}-{'async' if a else 'sync'}" for p, _, a in KILLS])
def test_kill_in_every_commit_phase(tmp_path, straight, phase, rank, async_save):
    a = straight(LAYOUT)
    g = gang.Gang(toy.train, 2, {"layout": LAYOUTS[LAYOUT], "path": str(tmp_path), "interval": 3,
                                 "keep_last": 1, "async": async_save,
                                 "die": {"rank": rank, "phase": phase, "step": 6}})
    try:
        codes = g.wait()
    finally:
        g.close()
    assert codes[rank] == -signal.SIGKILL, codes
    b = finish_and_compare(tmp_path, a, interval=3, keep_last=1, **{"async": async_save})
    committed = phase in ("published", "pruned")
    assert b["resumed"]["step"] == (6 if committed else 3), f"killed at {phase}"


def test_a_save_that_cannot_write_fails_clearly_and_loses_nothing(tmp_path, straight):
    """Rank 1's writes fail mid-save (a full disk, here a file-size limit): every rank stops with
    the reason, the partial step is removed, the last good checkpoint stays `latest`, and the
    resumed run ends exactly where the straight run does."""
    a = straight(LAYOUT)
    g = gang.Gang(toy.train, 2, {"layout": LAYOUTS[LAYOUT], "path": str(tmp_path), "interval": 3,
                                 "keep_last": 2, "disk_limit": {"rank": 1, "step": 6, "bytes": 1024}})
    try:
        codes = g.wait()
        results = g.results()
    finally:
        g.close()
    assert codes == [1, 1], codes
    for rank in (0, 1):
        kind, trace = results[rank]
        assert kind == "error" and "CheckpointError: saving step 6" in trace, trace
        assert "rank 1: OSError: [Errno 27] File too large; nothing was committed" in trace, trace
        assert "free space on the checkpoint volume" in trace, trace
    assert (tmp_path / "latest").read_text().strip() == "step-00000003"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000003"]  # no partial step 6
    b = finish_and_compare(tmp_path, a, interval=3, keep_last=2)
    assert b["resumed"]["step"] == 3


def wait_for_line(path: Path, line: str, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and line in path.read_text().splitlines():
            return True
        time.sleep(0.005)
    return False


def test_random_kills(tmp_path, straight):
    """12 runs, each SIGKILLed once at a random moment: half inside a save, half inside a step.

    A step of the toy model takes milliseconds, so the targeted step pauses for a second after its
    backward pass, and the kill lands at a random moment of that pause (gradients computed, the
    optimizer not yet stepped), whatever the machine's speed."""
    a = straight(LAYOUT)
    rng = random.Random(1234)
    landed = {"save": 0, "train": 0}
    kills = 0
    for i in range(12):
        path, progress = tmp_path / f"run{i}", tmp_path / f"progress{i}"
        progress.mkdir()
        target = "save" if i % 2 == 0 else "paused"
        async_save = i % 4 in (2, 3)
        victim, at = rng.randrange(2), rng.randint(2, 8)
        spec = {"layout": LAYOUTS[LAYOUT], "path": str(path), "interval": 1, "keep_last": 2,
                "async": async_save, "progress": str(progress)}
        if target == "paused":
            spec |= {"pause_at": at, "pause_s": 1.0}
        g = gang.Gang(toy.train, 2, spec)
        try:
            assert wait_for_line(progress / f"rank-{victim}", f"{target} {at}"), "the run never got there"
            time.sleep(rng.uniform(0, 0.01) if target == "save" else rng.uniform(0, 0.5))
            g.kill(victim)
            g.procs[victim].join(10)
            kills += 1
            landed["save" if toy.inside_save(progress / f"rank-{victim}") else "train"] += 1
            codes = g.wait()
        finally:
            g.close()
        assert codes[victim] == -signal.SIGKILL, f"run {i}: exit codes {codes}"
        finish_and_compare(path, a, interval=1, keep_last=2, **{"async": async_save})
    assert kills >= 10
    assert landed["save"] >= 3 and landed["train"] >= 3, landed


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_sigterm_saves_on_every_rank_and_exits_75(tmp_path, straight, async_save):
    a = straight(LAYOUT)
    progress = tmp_path / "progress"
    progress.mkdir()
    path = tmp_path / "ckpt"
    g = gang.Gang(toy.train, 2, {"layout": LAYOUTS[LAYOUT], "path": str(path), "interval": 1000,
                                 "async": async_save, "preemptible": True, "progress": str(progress),
                                 "pause_at": 4, "pause_s": 1.0})
    try:
        assert wait_for_line(progress / "rank-1", "paused 4")  # SIGTERM lands inside step 4
        g.kill(1, signal.SIGTERM)  # only rank 1 is signalled; rank 0 must stop with it
        codes = g.wait()
    finally:
        g.close()
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED]
    stopped = int((path / "latest").read_text().strip().split("-")[1])
    assert stopped == 4  # the step it was in, on both ranks
    b = finish_and_compare(path, a, interval=1000, **{"async": async_save})
    assert b["resumed"]["step"] == stopped
