"""Padded batches: every layout trains like one process, the loss being the mean over the global batch's
valid tokens.

The samples keep between 1 and seqLen labels (tests.trainer.probes.PaddedSource), so microbatches,
data-parallel ranks and context-parallel shards hold very different numbers of valid tokens:
a per-microbatch or per-rank mean would give other losses and other gradients.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.harness import Run, job, run_trainer
from tests.trainer.test_equivalence import LOSS_RTOL, MODEL, PARAM_ATOL, TRAINING

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# name: (parallelism, processes, training overrides)
LAYOUTS: dict[str, tuple[dict[str, object], int, dict[str, object]]] = {
    "dpShard2": ({"dpShard": 2}, 2, {}),
    "pp2-1F1B": ({"pp": 2, "ppSchedule": "1F1B"}, 2, {}),
    "tp2": ({"tp": 2}, 2, {}),
    "cp2-dpReplicate2": ({"cp": 2, "dpReplicate": 2}, 4, {}),
    # The chunked loss (projection and loss over 3 slices of each sequence) against the plain one-process
    # loss.
    "single-lossChunks3": ({}, 1, {"lossChunks": 3}),
    "dpShard2-lossChunks3": ({"dpShard": 2}, 2, {"lossChunks": 3}),
    "pp2-lossChunks3": ({"pp": 2, "ppSchedule": "1F1B"}, 2, {"lossChunks": 3}),
    "tp2-lossChunks3": ({"tp": 2}, 2, {"lossChunks": 3}),
    "cp2-tp2-lossChunks3": ({"cp": 2, "tp": 2}, 4, {"lossChunks": 3}),  # the data-parallel split: above
}


def train(tmp: Path, parallelism: dict[str, object], nproc: int, model: dict[str, object] | None = None,
          training: dict[str, object] | None = None) -> tuple[Run, dict[str, torch.Tensor]]:
    cfg = job(parallelism, nproc=nproc, model={**MODEL, **(model or {})},
              training={**TRAINING, **(training or {})})
    params = tmp / "params.pt"
    run = run_trainer(cfg, tmp, args=("--save-full-parameters", str(params)),
                      target="tests.trainer.probes:padded_training", timeout=300)
    assert run.codes == [0] * nproc, run.logs()
    return run, torch.load(params)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], dict[str, torch.Tensor]]:
    run, params = train(tmp_path_factory.mktemp("single"), {}, 1)
    return [r["loss"] for r in run.records], params


def compare(run: Run, params: dict[str, torch.Tensor],
            reference: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    ref_losses, ref_params = reference
    losses = [r["loss"] for r in run.records]
    assert len(losses) == len(ref_losses) == TRAINING["steps"]
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    param_diff = max((params[k] - ref_params[k]).abs().max().item() for k in ref_params)
    print(f"\n[padding] world {len(run.codes)}  max loss rel diff {loss_rel:.2e}  max param abs diff "
          f"{param_diff:.2e}")
    assert loss_rel < LOSS_RTOL, (losses, ref_losses)
    assert param_diff < PARAM_ATOL


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_padded_layout_matches_single_process(name: str, reference, tmp_path: Path) -> None:
    parallelism, nproc, training = LAYOUTS[name]
    compare(*train(tmp_path, parallelism, nproc, training=training), reference)


def test_padding_changes_the_loss(reference, tmp_path: Path) -> None:
    """Guard against passing vacuously: the padded data is not the unpadded data."""
    cfg = job({}, nproc=1, model=MODEL, training=TRAINING)
    run = run_trainer(cfg, tmp_path)
    assert run.codes == [0], run.logs()
    unpadded = [r["loss"] for r in run.records]
    assert max(abs(a - b) / b
               for a, b in zip(reference[0], unpadded, strict=True)) > 1e-2, (reference[0], unpadded)
