"""`tetrad_trainer.train.main` with fault injection, for the trainer's kill tests.

Environment (all optional):
  TETRAD_TEST_DIE=PHASE:STEP:RANK    SIGKILL rank RANK when the save of STEP reaches PHASE
  TETRAD_TEST_KILL=RANK:STEP:WHEN:S  SIGKILL rank RANK S seconds after the save of STEP begins
                                     (WHEN=save) or is committed (WHEN=train), async or not
  TETRAD_TEST_PROGRESS=DIR           append "save N", "saved N" and every save phase (up to
                                     "committed N") to DIR/rank-R
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

from tetrad_trainer import checkpoint, train


def _note(line: str) -> None:
    if directory := os.environ.get("TETRAD_TEST_PROGRESS"):
        with open(Path(directory) / f"rank-{os.environ['RANK']}", "a") as f:
            f.write(line + "\n")


def _kill_later(seconds: float) -> None:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGKILL))
    timer.daemon = True
    timer.start()


def main(argv: list[str]) -> int:
    rank = int(os.environ["RANK"])
    die = os.environ.get("TETRAD_TEST_DIE", "").split(":")
    kill = os.environ.get("TETRAD_TEST_KILL", "").split(":")

    def kill_armed(step: int, when: str) -> None:
        if len(kill) == 4 and (rank, step, when) == (int(kill[0]), int(kill[1]), kill[2]):
            _kill_later(float(kill[3]))

    def hook(phase: str, step: int) -> None:
        _note(f"{phase} {step}")
        if len(die) == 3 and (phase, step, rank) == (die[0], int(die[1]), int(die[2])):
            os.kill(os.getpid(), signal.SIGKILL)
        if phase == "committed":
            kill_armed(step, "train")

    checkpoint.phase_hook = hook
    save = checkpoint.Checkpointer.save

    def traced_save(self: checkpoint.Checkpointer, step: int, **kwargs: Any) -> Any:
        _note(f"save {step}")
        kill_armed(step, "save")
        result = save(self, step, **kwargs)
        _note(f"saved {step}")
        return result

    checkpoint.Checkpointer.save = traced_save  # type: ignore[method-assign]
    return train.main(argv)
