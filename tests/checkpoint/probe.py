"""`tetrad_trainer.train.main` with fault injection, for the trainer's kill tests.

Environment (all optional):
  TETRAD_TEST_DIE=PHASE:STEP:RANK    SIGKILL rank RANK when the save of STEP reaches PHASE
  TETRAD_TEST_KILL=RANK:STEP:WHEN:S  SIGKILL rank RANK S seconds after the save of STEP begins
                                     (WHEN=save) or is committed (WHEN=train), async or not;
                                     that save, or the next step, pauses for PAUSE seconds so
                                     the kill lands where it is aimed on any machine (S < PAUSE)
  TETRAD_TEST_PROGRESS=DIR           append "save N", "saved N" and every save phase (up to
                                     "committed N") to DIR/rank-R, and "starting" when the
                                     trainer starts building
  TETRAD_TEST_SLOW_START=S           the trainer's start-up (before the model is built) takes S
                                     seconds longer
  TETRAD_TEST_SLOW_SAVE=S            every save takes S seconds longer, after its DCP write (a
                                     slow filesystem), on every rank

Under torchrun: `torchrun -m tests.checkpoint.probe --config ...` (from the repository root).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tetrad_trainer import checkpoint, train
from tetrad_trainer.checkpoint import store


def _note(line: str) -> None:
    if directory := os.environ.get("TETRAD_TEST_PROGRESS"):
        with open(Path(directory) / f"rank-{os.environ['RANK']}", "a") as f:
            f.write(line + "\n")


def _kill_later(seconds: float) -> None:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGKILL))
    timer.daemon = True
    timer.start()


PAUSE = 1.0


def main(argv: list[str]) -> int:
    rank = int(os.environ["RANK"])
    die = os.environ.get("TETRAD_TEST_DIE", "").split(":")
    kill = os.environ.get("TETRAD_TEST_KILL", "").split(":")
    pause_next_step = threading.Event()

    def aimed(step: int, when: str) -> bool:
        return len(kill) == 4 and (rank, step, when) == (int(kill[0]), int(kill[1]), kill[2])

    def kill_armed(step: int, when: str) -> None:
        if aimed(step, when):
            _kill_later(float(kill[3]))
            if when == "train":
                pause_next_step.set()

    slow_save = float(os.environ.get("TETRAD_TEST_SLOW_SAVE", "0"))
    slow_start = float(os.environ.get("TETRAD_TEST_SLOW_START", "0"))

    def hook(phase: str, step: int) -> None:
        _note(f"{phase} {step}")
        if phase == "dcp-written" and slow_save:
            time.sleep(slow_save)
        if len(die) == 3 and (phase, step, rank) == (die[0], int(die[1]), int(die[2])):
            os.kill(os.getpid(), signal.SIGKILL)
        if phase == "dcp-written" and aimed(step, "save"):
            time.sleep(PAUSE)  # the save stays open until the kill
        if phase == "committed":
            kill_armed(step, "train")

    train_step = train.Trainer.train_step

    def paused_train_step(self: train.Trainer) -> Any:
        if pause_next_step.is_set():
            time.sleep(PAUSE)  # a step stays in progress until the kill
        return train_step(self)

    train.Trainer.train_step = paused_train_step  # type: ignore[method-assign]
    init = train.Trainer.__init__

    def slow_init(self: train.Trainer, *args: Any, **kwargs: Any) -> None:
        _note("starting")
        time.sleep(slow_start)
        init(self, *args, **kwargs)

    train.Trainer.__init__ = slow_init  # type: ignore[method-assign]

    store.phase_hook = hook
    save = checkpoint.Checkpointer.save

    def traced_save(self: checkpoint.Checkpointer, step: int, **kwargs: Any) -> Any:
        _note(f"save {step}")
        kill_armed(step, "save")
        result = save(self, step, **kwargs)
        _note(f"saved {step}")
        return result

    checkpoint.Checkpointer.save = traced_save  # type: ignore[method-assign]
    return train.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
