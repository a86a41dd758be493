"""The core guarantee: every layout trains the same model as one process does.

fp32 on CPU/gloo, the debug model (seqLen 64), 5 steps, gradient clipping active (the norms are
above 1): per-step losses within 1e-4 relative and the final parameters, gathered whole, within
1e-4 of the single-process run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.harness import Run, job, run_trainer

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TRAINING = {"steps": 5, "globalBatch": 8, "microBatch": 2, "precision": "fp32", "lr": 1e-3, "warmupSteps": 2,
            "gradClip": 1.0, "seed": 7}
MODEL = {"seqLen": 64}
# name: (parallelism, nodes, processes per node[, training overrides])
LAYOUTS: dict[str, (tuple[dict[str, object], int, int]
                    | tuple[dict[str, object], int, int, dict[str, object]])] = {
    "dpReplicate2": ({"dpReplicate": 2}, 1, 2),
    "dpShard2": ({"dpShard": 2}, 1, 2),
    "tp2": ({"tp": 2}, 1, 2),
    "cp2": ({"cp": 2}, 1, 2),
    "pp2-GPipe": ({"pp": 2, "ppSchedule": "GPipe"}, 1, 2),
    "pp2-1F1B": ({"pp": 2, "ppSchedule": "1F1B"}, 1, 2),
    "pp2-Interleaved1F1B": ({"pp": 2, "ppSchedule": "Interleaved1F1B"}, 1, 2),
    "pp2-ZeroBubble": ({"pp": 2, "ppSchedule": "ZeroBubble"}, 1, 2),
    "dpShard2-tp2": ({"dpShard": 2, "tp": 2}, 1, 4),
    "dpReplicate2-dpShard2": ({"dpReplicate": 2, "dpShard": 2}, 1, 4),
    "dpReplicate2-tp2": ({"dpReplicate": 2, "tp": 2}, 1, 4),
    "pp2-tp2": ({"pp": 2, "tp": 2}, 1, 4),
    "pp2-ZeroBubble-dpShard2": ({"pp": 2, "ppSchedule": "ZeroBubble", "dpShard": 2}, 1, 4),
    "dpShard2-cp2-tp2": ({"dpShard": 2, "cp": 2, "tp": 2}, 2, 4),
    "pp2-dpShard2-tp2": ({"pp": 2, "dpShard": 2, "tp": 2}, 2, 4),
    "pp2-dpShard2-cp2-tp2": ({"pp": 2, "dpShard": 2, "cp": 2, "tp": 2}, 2, 8),
    # Recomputation must not change the numbers.
    "dpShard2-tp2-fullAC": ({"dpShard": 2, "tp": 2}, 1, 4, {"activationCheckpointing": "full"}),
    "pp2-cp2-selectiveAC": ({"pp": 2, "cp": 2}, 1, 4, {"activationCheckpointing": "selective"}),
    # ZeRO-2 behaviour (parameters gathered from forward to backward) and FSDP's CPU offload; on CPU
    # the offload policy runs FSDP's offload code path with nothing to copy (no pinned memory).
    "dpShard2-zero2": ({"dpShard": 2}, 1, 2, {"fsdp": {"reshardAfterForward": False}}),
    "dpShard2-offload": ({"dpShard": 2}, 1, 2, {"fsdp": {"offload": "cpu"}}),
    "dpShard2-tp2-zero2-offload": ({"dpShard": 2, "tp": 2}, 1, 4,
                                   {"fsdp": {"reshardAfterForward": False, "offload": "cpu"}}),
}
LOSS_RTOL = 1e-4
PARAM_ATOL = 1e-4


def train(tmp: Path, parallelism: dict[str, object], nodes: int, nproc: int,
          training: dict[str, object] | None = None, *, model: dict[str, object] = MODEL,
          env: dict[str, str] | None = None,
          data: dict[str, object] | None = None) -> tuple[Run, dict[str, torch.Tensor]]:
    cfg = job(parallelism, nodes=nodes, nproc=nproc, model=model, training={**TRAINING, **(training or {})},
              **({"data": data} if data is not None else {}))
    params = tmp / "params.pt"
    run = run_trainer(cfg, tmp, args=("--save-full-parameters", str(params)), timeout=480, env=env)
    assert run.codes == [0] * cfg.world_size, run.logs()
    return run, torch.load(params)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], dict[str, torch.Tensor]]:
    run, params = train(tmp_path_factory.mktemp("single"), {}, 1, 1)
    losses = [r["loss"] for r in run.records]
    assert len(losses) == TRAINING["steps"]
    return losses, params


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name: str, reference: tuple[list[float], dict[str, torch.Tensor]],
                                       tmp_path: Path) -> None:
    assert_matches(name, reference, *train(tmp_path, *LAYOUTS[name]))


def assert_matches(name: str, reference: tuple[list[float], dict[str, torch.Tensor]], run: Run,
                   params: dict[str, torch.Tensor], model: dict[str, object] = MODEL,
                   unmoved: tuple[str, ...] = ()) -> None:
    """Per-step losses and final parameters of run within the tolerances of the single-process reference.
    unmoved: name suffixes of parameters that get no gradient (left out of the check that training moved
    them)."""
    ref_losses, ref_params = reference
    losses = [r["loss"] for r in run.records]
    assert [r["step"] for r in run.records] == list(range(1, TRAINING["steps"] + 1))
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    assert params.keys() == ref_params.keys()
    param_diff = max((params[k] - ref_params[k]).abs().max().item() for k in ref_params)
    moved = min((ref_params[k] - initial).abs().max().item()
                for k, initial in _initial(ref_params, model).items() if not k.endswith(unmoved))
    print(f"\n[equivalence] {name:24s} world {len(run.codes):2d}  max loss rel diff {loss_rel:.2e}"
          f"  max param abs diff {param_diff:.2e}  ({run.seconds:.1f} s)")
    assert loss_rel < LOSS_RTOL, (losses, ref_losses)
    assert param_diff < PARAM_ATOL
    assert moved > 10 * PARAM_ATOL, "training barely moved the weights: the comparison would prove nothing"


def _initial(params: dict[str, torch.Tensor], model: dict[str, object]) -> dict[str, torch.Tensor]:
    from tetrad_trainer.model import initial_value

    cfg = job({}, nproc=1, model=model, training=TRAINING)
    return {k: initial_value(k, v.shape, cfg.model, cfg.training.seed) for k, v in params.items()}


# Fine-tuning data (data.source: jsonl): prompt tokens, the text between assistant turns and padding are
# not learned, so each rank's share of the global batch holds a different number of learned tokens.
# 24 lines of prompt/completion and chat, padded (24 rows) or packed: 5 steps of 8 rows cross an epoch.
JSONL_LAYOUTS: dict[str, tuple[dict[str, object], int, int]] = {
    "dpShard2": ({"dpShard": 2}, 1, 2),
    "tp2": ({"tp": 2}, 1, 2),
}


@pytest.fixture(scope="module", params=[False, True], ids=["padded", "packed"])
def jsonl_reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                    ) -> tuple[dict[str, object], tuple[list[float], dict[str, torch.Tensor]]]:
    from tests.trainer.sft_data import mixed_lines, sft_data

    path, tokenizer = sft_data(tmp_path_factory.mktemp("sft-data"), mixed_lines(24))
    data: dict[str, object] = {"source": "jsonl", "path": str(path), "tokenizer": str(tokenizer),
                               "packing": request.param}
    run, params = train(tmp_path_factory.mktemp("sft-single"), {}, 1, 1, data=data)
    return data, ([r["loss"] for r in run.records], params)


@pytest.mark.parametrize("name", list(JSONL_LAYOUTS))
def test_jsonl_layout_matches_single_process(name: str, jsonl_reference: tuple[dict[str, object], tuple[
        list[float], dict[str, torch.Tensor]]], tmp_path: Path) -> None:
    data, reference = jsonl_reference
    assert_matches(f"jsonl-{name}", reference, *train(tmp_path, *JSONL_LAYOUTS[name], data=data))
