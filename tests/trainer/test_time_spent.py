"""The trainer's account of its time for the job's goodput: start-up to the end of the first step, then
training, less the waits on checkpoint saves (which before the first step's end are start-up)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tetrad_trainer import time_spent
from tetrad_trainer.time_spent import TimeSpent


def test_training_time_runs_from_the_first_steps_end_less_the_checkpoint_stalls(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(time_spent.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(time_spent, "seconds_since_process_start", lambda: 12.5)
    spent = TimeSpent()
    assert spent.record() == {"startup_s": 0.0, "train_s": 0.0, "checkpoint_stall_s": 0.0}
    with spent.checkpoint_stall():  # a save before the first step ends is start-up
        clock[0] += 3.0
    assert spent.step_completed() and not spent.step_completed()
    clock[0] += 10.0
    with spent.checkpoint_stall():
        clock[0] += 4.0
    clock[0] += 1.0
    spent.stalled(0.5)  # a script's save, as the runtime library times it
    assert spent.record() == {"startup_s": 12.5, "train_s": 10.5, "checkpoint_stall_s": 4.5}


def test_a_stall_that_raises_is_still_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(time_spent.time, "perf_counter", lambda: clock[0])
    spent = TimeSpent()
    spent.step_completed()
    with pytest.raises(OSError), spent.checkpoint_stall():
        clock[0] += 2.0
        raise OSError("disk full")
    assert spent.checkpoint_stall_s == 2.0


def test_process_start_is_read_from_proc() -> None:
    # a fresh process (this one may be hours old at the end of a long suite): its age after a known sleep
    code = ("import time; time.sleep(1.0); from tetrad_trainer import time_spent;"
            " print(time_spent.seconds_since_process_start())")
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               timeout=120).stdout)
    assert 0.9 < age < 100, age
