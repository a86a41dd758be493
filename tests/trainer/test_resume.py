"""The trainer's use of the checkpointer: a resumed run continues the uninterrupted one, across layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.harness import job, rewind, run_trainer

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TRAINING = {"steps": 4, "globalBatch": 4, "microBatch": 1, "precision": "fp32", "lr": 1e-3, "warmupSteps": 1,
            "seed": 2}


def test_resume_from_step_2_under_another_layout_continues_the_same_run(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    checkpoint = {"enabled": True, "path": str(ckpt), "interval": 2}
    model = {"seqLen": 32}
    first = job({"dpShard": 2}, nproc=2, model=model, training=TRAINING, checkpoint=checkpoint)
    full = run_trainer(first, tmp_path / "full", args=("--save-full-parameters", str(tmp_path / "full.pt")))
    assert full.codes == [0, 0], full.logs()
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000002", "step-00000004"]

    # Forget the last checkpoint: the next run resumes after step 2, on a TP x PP layout with
    # checkpoint-wrapped blocks (their parameter names carry a wrapper prefix).
    rewind(ckpt, 2)
    second = job({"pp": 2, "tp": 2}, nproc=4, model=model,
                 training={**TRAINING, "activationCheckpointing": "full"}, checkpoint=checkpoint)
    resumed = run_trainer(second, tmp_path / "resumed",
                          args=("--save-full-parameters", str(tmp_path / "resumed.pt")))
    assert resumed.codes == [0] * 4, resumed.logs()
    assert "resumed step 2" in resumed.log(0)

    assert [r["step"] for r in resumed.records] == [3, 4]
    for a, b in zip(resumed.records, full.records[2:], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["lr"] == pytest.approx(b["lr"])
    want, got = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    assert max((want[k] - got[k]).abs().max().item() for k in want) < 1e-4
