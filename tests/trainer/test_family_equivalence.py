"""The core guarantee for the families' options: a Qwen3-shaped model (per-head q/k RMSNorm, head_dim apart
from dim/heads), a tied Llama-3.2-shaped one (tied embedding, llama3 RoPE scaling) and a Qwen2.5-shaped one
(q/k/v biases) train in every kind of layout as in one process.

As test_equivalence.py: fp32 on CPU/gloo, 5 steps, gradient clipping active; per-step losses within 1e-4
relative and the final parameters, gathered whole, within 1e-4 of the one-process run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.test_equivalence import assert_matches, train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCALING = {"type": "llama3", "factor": 32.0, "lowFreqFactor": 1.0, "highFreqFactor": 4.0,
           "originalMaxPositions": 8192}
MODELS: dict[str, dict[str, object]] = {
    "qwen3": {"family": "qwen3", "dim": 64, "heads": 4, "kvHeads": 2, "headDim": 32, "layers": 4,
              "vocab": 256, "ffnDim": 128, "seqLen": 64, "ropeTheta": 1e6, "normEps": 1e-6},
    "llama3.2-tied": {"family": "llama", "dim": 64, "heads": 4, "kvHeads": 2, "layers": 4, "vocab": 256,
                      "ffnDim": 128, "seqLen": 64, "ropeScaling": SCALING, "tieEmbeddings": True},
    "qwen2.5": {"family": "qwen2", "dim": 64, "heads": 4, "kvHeads": 2, "layers": 4, "vocab": 256,
                "ffnDim": 128, "seqLen": 64, "ropeTheta": 1e6, "normEps": 1e-6},
}
LAYOUTS: dict[str, tuple[dict[str, object], int, int]] = {
    "dpShard2": ({"dpShard": 2}, 1, 2),
    # biases sharded with their rows; q/k norms replicated, gradients summed over tp
    "tp2": ({"tp": 2}, 1, 2),
    "cp2": ({"cp": 2}, 1, 2),  # the norms act per position on the rank's chunks
    "pp2": ({"pp": 2}, 1, 2),  # the tie: a copy on each end, gradients summed
}
CASES = [(m, layout) for m in ("qwen3", "llama3.2-tied") for layout in LAYOUTS] + [("qwen2.5", "dpShard2"),
                                                                                   ("qwen2.5", "tp2")]
_REFERENCES: dict[str, tuple[list[float], dict[str, torch.Tensor]]] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    def get(model: str) -> tuple[list[float], dict[str, torch.Tensor]]:
        if model not in _REFERENCES:
            run, params = train(tmp_path_factory.mktemp(f"single-{model}"), {}, 1, 1, model=MODELS[model])
            _REFERENCES[model] = [r["loss"] for r in run.records], params
        return _REFERENCES[model]
    return get


@pytest.mark.parametrize("model, layout", CASES, ids=[f"{m}-{layout}" for m, layout in CASES])
def test_family_layout_matches_single_process(  # type: ignore[no-untyped-def]
        model: str, layout: str, reference, tmp_path: Path) -> None:
    run, params = train(tmp_path, *LAYOUTS[layout], model=MODELS[model])
    # Softmax ignores what the key bias adds (the same q·b for every key of a query): it gets no gradient.
    assert_matches(f"{model} {layout}", reference(model), run, params, MODELS[model], unmoved=("wk.bias",))
    if MODELS[model].get("tieEmbeddings"):
        assert params["output.weight"].equal(params["tok_embeddings.weight"]), "the tied copies drifted apart"
