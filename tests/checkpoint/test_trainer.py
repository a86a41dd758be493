"""Checkpoints through the real trainer (debug model, fp32, CPU/gloo).

Exact resume: run A trains 10 steps straight; run B is SIGKILLed right after committing step 5
and resumed to step 10: its losses at steps 6-10 and final parameters equal A's bit for bit.
Resharding: B resumes under another layout and stays within reduction-order noise of A.
Kills: rank SIGKILLed at random moments inside saves and steps, ten times; every resumed run ends
with A's final loss and parameters.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint.toy import inside_save
from tests.trainer.harness import Run, job, run_trainer

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PROBE = "tests.checkpoint.probe:main"
TRAINING = {"steps": 10, "globalBatch": 4, "microBatch": 1, "precision": "fp32", "lr": 2e-3, "warmupSteps": 2,
            "seed": 3}
MODEL = {"seqLen": 64}
LAYOUTS: dict[str, tuple[dict[str, int], int]] = {
    "dps2": ({"dpShard": 2}, 2),
    "dps4": ({"dpShard": 4}, 4),
    "tp2xdps2": ({"tp": 2, "dpShard": 2}, 4),
    "pp2xtp2": ({"pp": 2, "tp": 2}, 4),
    "pp2": ({"pp": 2}, 2),
    # Two stages per rank held by one optimizer: saved through checkpoint.merged_view.
    "pp2-interleaved": ({"pp": 2, "ppSchedule": "Interleaved1F1B"}, 2),
    "single": ({}, 1),
}


def config(layout: str, ckpt: Path | None, **checkpoint: Any):
    parallelism, nproc = LAYOUTS[layout]
    spec = {"checkpoint": {"enabled": True, "path": str(ckpt), "interval": 5, **checkpoint}} if ckpt else {}
    return job(parallelism, nproc=nproc, model=MODEL, training=TRAINING, **spec)


def train(layout: str, out: Path, ckpt: Path | None, env: dict[str, str] | None = None,
          **checkpoint: Any) -> Run:
    return run_trainer(config(layout, ckpt, **checkpoint), out, target=PROBE, env=env,
                       args=("--save-full-parameters", str(out / "params.pt")))


def losses(run: Run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run.records}


def params(run: Run) -> dict[str, torch.Tensor]:
    return torch.load(run.out / "params.pt")


_straight: dict[str, Run] = {}


def straight(layout: str, tmp: Path) -> Run:
    if layout not in _straight:
        run = train(layout, tmp / f"straight-{layout}", None)
        assert run.codes == [0] * len(run.codes), run.logs()
        _straight[layout] = run
    return _straight[layout]


def kill_after_commit(layout: str, tmp: Path, ckpt: Path, **checkpoint: Any) -> None:
    run = train(layout, tmp / "killed", ckpt, env={"TETRAD_TEST_DIE": "published:5:0"}, **checkpoint)
    assert run.codes[0] == -9, run.logs()
    assert (ckpt / "latest").read_text() == "step-00000005\n"


def assert_continues(b: Run, a: Run, tol: float) -> None:
    la, lb = losses(a), losses(b)
    assert sorted(lb) == [6, 7, 8, 9, 10], b.log(0)
    for s in range(6, 11):
        assert abs(la[s] - lb[s]) <= tol * abs(la[s]), f"step {s}: {lb[s]!r} resumed, {la[s]!r} straight"
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        if tol == 0:
            assert torch.equal(pa[k], pb[k]), k
        else:
            torch.testing.assert_close(pb[k], pa[k], rtol=tol, atol=tol)


@pytest.mark.parametrize(("layout", "async_save"), [
    (layout, async_save) for layout in ("dps2", "tp2xdps2", "pp2xtp2") for async_save in (False, True)
] + [("pp2-interleaved", False)], ids=lambda v: {False: "sync", True: "async"}.get(v, v))
def test_exact_resume(tmp_path_factory, tmp_path, layout, async_save):
    a = straight(layout, tmp_path_factory.getbasetemp())
    ckpt = tmp_path / "ckpt"
    kill_after_commit(layout, tmp_path, ckpt, **{"async": async_save})
    b = train(layout, tmp_path / "resumed", ckpt, **{"async": async_save})
    assert b.codes == [0] * len(b.codes), b.logs()
    label = config(layout, ckpt).layout.label()
    assert (f"resumed step 5 from {ckpt}/step-00000005 (saved with layout {label}, now {label}; restart 0)"
            in b.log(0))
    assert_continues(b, a, tol=0)


@pytest.mark.parametrize(("before", "after"), [("dps4", "tp2xdps2"), ("pp2", "single"),
                                               ("pp2-interleaved", "dps2")])
def test_reshard(tmp_path_factory, tmp_path, before, after):
    a = straight(before, tmp_path_factory.getbasetemp())
    ckpt = tmp_path / "ckpt"
    kill_after_commit(before, tmp_path, ckpt)
    b = train(after, tmp_path / "resumed", ckpt)
    assert b.codes == [0] * len(b.codes), b.logs()
    saved, now = config(before, ckpt).layout.label(), config(after, ckpt).layout.label()
    assert f"(saved with layout {saved}, now {now}; restart 0)" in b.log(0)
    assert "model and optimizer resharded" in b.log(0)
    assert_continues(b, a, tol=1e-5)


def test_shrinking_the_data_parallel_degree_and_growing_it_back_continues_the_same_run(tmp_path_factory,
                                                                                       tmp_path):
    """What an elastic job's restarts do: 4 data-parallel ranks to step 5, then 2 (the same global batch,
    twice the gradient accumulation) to step 8, then 4 again: the same updates as the straight run."""
    a = straight("dps4", tmp_path_factory.getbasetemp())
    ckpt = tmp_path / "ckpt"
    kill_after_commit("dps4", tmp_path, ckpt)
    shrunk = train("dps2", tmp_path / "shrunk", ckpt, env={"TETRAD_TEST_DIE": "published:8:0"}, interval=1)
    assert shrunk.codes[0] == -9, shrunk.logs()
    assert "resumed step 5" in shrunk.log(0) and "model and optimizer resharded" in shrunk.log(0)
    grown = train("dps4", tmp_path / "grown", ckpt)
    assert grown.codes == [0] * 4, grown.logs()
    assert "resumed step 8" in grown.log(0) and "model and optimizer resharded" in grown.log(0)
    straight_losses, tol = losses(a), 1e-4
    resumed = {**losses(shrunk), **losses(grown)}
    assert sorted(resumed) == [6, 7, 9, 10], resumed  # step 8's line: killed once it was committed
    for s, loss in resumed.items():
        assert abs(loss - straight_losses[s]) <= tol * abs(straight_losses[s]), (s, loss, straight_losses[s])
    pa, pb = params(a), params(grown)
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=tol, atol=tol)


def test_model_dims_change_exits_78_naming_both_layouts(tmp_path):
    ckpt = tmp_path / "ckpt"
    kill_after_commit("dps2", tmp_path, ckpt)
    parallelism, nproc = LAYOUTS["tp2xdps2"]
    other = job(parallelism, nproc=nproc, model={**MODEL, "layers": 2}, training=TRAINING,
                checkpoint={"enabled": True, "path": str(ckpt)})
    run = run_trainer(other, tmp_path / "other")
    assert run.codes == [78] * 4, run.logs()
    assert ("layout pp1.dpr1.dps2.cp1.tp1" in run.log(0) and "layout pp1.dpr1.dps2.cp1.tp2" in run.log(0)
            and "layers 4 -> 2" in run.log(0))


def test_another_jobs_checkpoint_exits_78_naming_both_jobs(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = job({}, nproc=1, model=MODEL, training={**TRAINING, "steps": 1},
                checkpoint={"enabled": True, "path": str(ckpt)})
    assert run_trainer(first, tmp_path / "first").codes == [0]
    other = run_trainer(first.model_copy(update={"job_name": "other"}), tmp_path / "other")
    assert other.codes == [78], other.logs()
    assert (f"config error: spec.checkpoint.path: {ckpt} holds checkpoint step 1 of the job 'test', not of "
            "this job 'other'; give this job its own checkpoint.path, or set checkpoint.allowForeign: "
            "true") in other.log(0)


def test_restart_count_is_logged(tmp_path):
    ckpt = tmp_path / "ckpt"
    kill_after_commit("dps2", tmp_path, ckpt)
    run = train("dps2", tmp_path / "resumed", ckpt, env={"TETRAD_RESTART": "4"})
    assert run.codes == [0, 0], run.logs()
    assert "resumed step 5" in run.log(0) and "restart 4)" in run.log(0)
    assert '"restart": 4' in (ckpt / "step-00000010" / "MANIFEST.json").read_text()


def test_random_kills(tmp_path_factory, tmp_path):
    """Four runs of the trainer, each with one rank SIGKILLed at a random moment inside a save or a step,
    with synchronous and asynchronous saves (tests/checkpoint/test_kill.py kills the toy trainer at many
    more moments)."""
    a = straight("dps2", tmp_path_factory.getbasetemp())
    rng = random.Random(6)
    landed = []
    for i in range(4):
        ckpt, progress = tmp_path / f"ckpt{i}", tmp_path / f"progress{i}"
        progress.mkdir()
        victim, step, when = rng.randrange(2), rng.choice([2, 4, 6]), "save" if i % 2 == 0 else "train"
        delay = rng.uniform(0, 0.1 if when == "save" else 0.3)
        settings = {"interval": 2, "keepLast": 2, "async": i >= 2}
        killed = train("dps2", tmp_path / f"killed{i}", ckpt, env={
            "TETRAD_TEST_KILL": f"{victim}:{step}:{when}:{delay}", "TETRAD_TEST_PROGRESS": str(progress)},
            **settings)
        assert killed.codes[victim] == -9, killed.logs()
        events = (progress / f"rank-{victim}").read_text().splitlines()
        landed.append(f"saving ({events[-1]})" if inside_save(progress / f"rank-{victim}") else "training")
        b = run_trainer(config("dps2", ckpt, **settings), tmp_path / f"resumed{i}", target=PROBE,
                        args=("--save-full-parameters", str(tmp_path / f"resumed{i}" / "params.pt")))
        assert b.codes == [0, 0], b.logs()
        assert b.records[-1]["step"] == 10 and b.records[-1]["loss"] == a.records[-1]["loss"], (i, landed[-1])
        pa, pb = params(a), params(b)
        assert all(torch.equal(pa[k], pb[k]) for k in pa), (i, landed[-1])
    print("kills landed:", landed)
    assert sum(x.startswith("saving") for x in landed) >= 1 and landed.count("training") >= 1, landed


def test_activation_checkpointing_leaves_the_names_alone(tmp_path):
    """Blocks wrapped for activation checkpointing save under the plain model's names, so a run
    with AC resumes without it (and back)."""
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "ckpt"
    parallelism, nproc = LAYOUTS["dps2"]
    settings = {"enabled": True, "path": str(ckpt), "interval": 3}
    with_ac = job(parallelism, nproc=nproc, model=MODEL, checkpoint=settings,
                  training={**TRAINING, "steps": 3, "activationCheckpointing": "full"})
    assert run_trainer(with_ac, tmp_path / "ac").codes == [0, 0]
    keys = dcp.FileSystemReader(str(ckpt / "step-00000003")).read_metadata().state_dict_metadata
    assert "model.layers.0.attention.wq.weight" in keys
    assert not [k for k in keys if "_checkpoint_wrapped_module" in k or "_orig_mod" in k]
    without = job(parallelism, nproc=nproc, model=MODEL, checkpoint=settings,
                  training={**TRAINING, "steps": 5})
    run = run_trainer(without, tmp_path / "plain")
    assert run.codes == [0, 0], run.logs()
    assert "resumed step 3" in run.log(0) and [r["step"] for r in run.records] == [4, 5]
