"""Running out of device memory: every rank exits EXIT_OOM with a message that says what to change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tetrad_trainer.oom import out_of_memory_message

from tests.trainer.harness import job, run_trainer
from tetrad.api.contract import ENV_TEST_OOM_AT_STEP, EXIT_OOM


def test_message_names_the_step_the_memory_the_prediction_and_the_knobs() -> None:
    cfg = job({"dpShard": 2}, nproc=2, training={"microBatch": 2, "globalBatch": 8,
                                                 "activationCheckpointing": "selective"})
    cfg = cfg.model_copy(update={"predicted_peak_bytes": 60.6 * 1024**3})
    msg = out_of_memory_message(cfg, torch.device("cpu"), 7,
                                torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 15.70 GiB\n"
                                                       "more"))
    assert msg.startswith("out of device memory in step 7 on cpu: ")
    assert "GiB total, peak " in msg and "the planner predicted a peak of 60.6 GiB" in msg
    for knob in ("training.microBatch (now 2)",
                 "training.activationCheckpointing selective or full (now selective)",
                 "training.lossChunks > 1 (now 1)", "dpShard=2, tp=1, pp=1"):
        assert knob in msg, knob
    assert msg.endswith("Error: CUDA out of memory. Tried to allocate 15.70 GiB")
    unplanned = out_of_memory_message(cfg.model_copy(update={"predicted_peak_bytes": None}),
                                      torch.device("cpu"), 1, torch.OutOfMemoryError())
    assert "no planner prediction in the config" in unplanned


@pytest.mark.distributed
def test_out_of_memory_on_every_rank_exits_77_with_the_message(tmp_path: Path) -> None:
    cfg = job({"dpShard": 2}, nproc=2, model={"seqLen": 32}, training={"steps": 4, "globalBatch": 2})
    run = run_trainer(cfg, tmp_path, env={ENV_TEST_OOM_AT_STEP: "2"})
    assert run.codes == [EXIT_OOM, EXIT_OOM], run.logs()
    for rank in (0, 1):
        log = run.log(rank)
        assert "out of device memory in step 2 on cpu" in log, log
        assert f"injected by {ENV_TEST_OOM_AT_STEP}=2" in log
    assert [r["step"] for r in run.records] == [1]  # step 1 completed and was logged; step 2 never finished
