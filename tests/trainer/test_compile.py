"""torch.compile per block (with activation checkpointing) trains the same numbers as eager."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.harness import job, run_trainer

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TRAINING = {"steps": 3, "globalBatch": 4, "microBatch": 2, "precision": "fp32", "seed": 1}


def test_compiled_checkpointed_blocks_match_eager(tmp_path: Path) -> None:
    losses = {}
    for name, extra in (("eager", {}), ("compiled", {"compile": True, "activationCheckpointing": "full"})):
        cfg = job({"dpShard": 2}, nproc=2, model={"seqLen": 32}, training={**TRAINING, **extra})
        run = run_trainer(cfg, tmp_path / name, timeout=900)
        assert run.codes == [0, 0], run.logs()
        losses[name] = [r["loss"] for r in run.records]
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4)
