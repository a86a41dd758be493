"""Checkpoints, metrics and the loop's figures for a model of one's own (the GPT-2 example): a run
resumed from step 2 continues the uninterrupted one, exactly in the same layout and within the
reduction-order noise in another, the tied embedding crossing between one parameter (no pipeline)
and a copy per end (pipeline stages) both ways; its JSON lines carry MFU from the definition's FLOPs."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.trainer import plugin
from tests.trainer.harness import Run, job, rewind, run_trainer

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TRAINING = {"steps": 4, "globalBatch": 4, "microBatch": 1, "precision": "fp32", "lr": 1e-3, "warmupSteps": 1,
            "gradClip": 1.0, "seed": 2}
PEAK_TFLOPS = 0.5


@pytest.fixture(scope="module", autouse=True)
def _importable() -> Iterator[None]:
    with plugin.importable():
        yield


def train(parallelism: dict[str, object], nproc: int, ckpt: Path,
          out: Path) -> tuple[Run, dict[str, torch.Tensor]]:
    cfg = job(parallelism, nproc=nproc, model=plugin.GPT2, training=TRAINING,
              metrics={"peakTflops": PEAK_TFLOPS},
              checkpoint={"enabled": True, "path": str(ckpt), "interval": 2})
    run = run_trainer(cfg, out, args=("--save-full-parameters", str(out / "params.pt"), "--jsonl",
                                      str(out / "m.jsonl")),
                      env=plugin.env())
    assert run.codes == [0] * nproc, run.logs()
    return run, torch.load(out / "params.pt")


def from_step_2(ckpt: Path, to: Path) -> Path:
    """A copy of the checkpoint directory whose latest is step 2."""
    shutil.copytree(ckpt, to)
    return rewind(to, 2)


@pytest.fixture(scope="module")
def straight(
        tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Run, dict[str, torch.Tensor]]]:
    """Uninterrupted 4-step runs with checkpoints at steps 2 and 4: one pipelined (the tied embedding split
    into a copy per end), one not (one parameter)."""
    runs = {}
    for name, parallelism in (("pp2", {"pp": 2}), ("dpShard2", {"dpShard": 2})):
        tmp = tmp_path_factory.mktemp(name)
        runs[name] = (tmp / "ckpt", *train(parallelism, 2, tmp / "ckpt", tmp / "run"))
    return runs


@pytest.mark.parametrize("before, after, nproc, exact", [
    ("pp2", {"pp": 2}, 2, True),
    ("pp2", {"dpShard": 2, "tp": 2}, 4, False),  # two copies -> one parameter
    ("dpShard2", {"pp": 2, "tp": 2}, 4, False),  # one parameter -> a copy per pipeline end
], ids=["pp2-exact", "pp2-to-dpShard2-tp2", "dpShard2-to-pp2-tp2"])
def test_resumed_run_continues_the_straight_one(straight, before: str, after: dict[str, object], nproc: int,
                                                exact: bool, tmp_path: Path) -> None:
    ckpt, full, want = straight[before]
    run, got = train(after, nproc, from_step_2(ckpt, tmp_path / "ckpt"), tmp_path / "run")
    assert "resumed step 2" in run.log(0)
    assert [r["step"] for r in run.records] == [3, 4]
    losses, straight_losses = [r["loss"] for r in run.records], [r["loss"] for r in full.records[2:]]
    assert got.keys() == want.keys() and got["lm_head.weight"].equal(got["wte.weight"])
    if exact:
        assert losses == straight_losses
        assert all(torch.equal(got[k], want[k]) for k in want)
    else:
        assert losses == pytest.approx(straight_losses, rel=1e-4)
        assert max((want[k] - got[k]).abs().max().item() for k in want) < 1e-4


def test_json_lines_carry_mfu_from_the_definitions_flops(straight) -> None:
    from tetrad_trainer.models.loader import load_definition

    _, run, _ = straight["dpShard2"]
    cfg = job({"dpShard": 2}, nproc=2, model=plugin.GPT2).model
    flops = load_definition(cfg.module).flops_per_token(cfg)
    assert flops != cfg.flops_per_token()  # not the planner's Llama formula
    assert [r["step"] for r in run.records] == [1, 2, 3, 4]
    for r in run.records:
        assert r["tflops"] == pytest.approx(flops * r["tokens_per_second"] / 2 / 1e12, rel=1e-9)
        assert r["mfu"] == pytest.approx(r["tflops"] / PEAK_TFLOPS, rel=1e-9)
