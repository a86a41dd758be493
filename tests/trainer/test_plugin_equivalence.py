"""The core guarantee for a model of one's own: the GPT-2 example (examples/bring-your-own/model),
written only against tetrad_trainer.models, trains in every layout as in one process.

As test_equivalence.py for the built-in Llama: fp32 on CPU/gloo, 5 steps, gradient clipping active;
per-step losses within 1e-4 relative and the final parameters, gathered whole (the tied embedding
under both its names: under a pipeline each end holds a copy), within 1e-4 of the one-process run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.trainer import plugin
from tests.trainer.test_equivalence import assert_matches, train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# name: (parallelism, nodes, processes per node[, training overrides])
LAYOUTS: dict[str, (tuple[dict[str, object], int, int]
                    | tuple[dict[str, object], int, int, dict[str, object]])] = {
    "dpShard2": ({"dpShard": 2}, 1, 2),
    "dpReplicate2": ({"dpReplicate": 2}, 1, 2),
    "tp2": ({"tp": 2}, 1, 2),
    "cp2": ({"cp": 2}, 1, 2),
    # the tied embedding and output on two ranks (1F1B, interleaved) or on one rank's two stages (the V)
    "pp2-1F1B": ({"pp": 2, "ppSchedule": "1F1B"}, 1, 2),
    "pp2-Interleaved1F1B": ({"pp": 2, "ppSchedule": "Interleaved1F1B"}, 1, 2),
    "pp2-ZeroBubble": ({"pp": 2, "ppSchedule": "ZeroBubble"}, 1, 2),
    "pp2-tp2": ({"pp": 2, "tp": 2}, 1, 4),  # the copies' gradients as TP leaves them, no FSDP to shard them
    "dpReplicate2-tp2": ({"dpReplicate": 2, "tp": 2}, 1, 4),  # FSDP2's replicate: the tie in the root's unit
    "tp2-lossChunks2": ({"tp": 2}, 1, 2, {"lossChunks": 2}),  # the loss calls the (tied) output projection
    "dpShard2-cp2-tp2": ({"dpShard": 2, "cp": 2, "tp": 2}, 2, 4),
    "pp2-dpShard2-cp2-tp2": ({"pp": 2, "dpShard": 2, "cp": 2, "tp": 2}, 2, 8),
}


@pytest.fixture(scope="module", autouse=True)
def _importable() -> Iterator[None]:
    with plugin.importable():
        yield


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], dict[str, torch.Tensor]]:
    run, params = train(tmp_path_factory.mktemp("single"), {}, 1, 1, model=plugin.GPT2, env=plugin.env())
    assert params["lm_head.weight"].equal(params["wte.weight"])
    return [r["loss"] for r in run.records], params


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gpt2_layout_matches_single_process(name: str, reference: tuple[list[float], dict[str, torch.Tensor]],
                                            tmp_path: Path) -> None:
    run, params = train(tmp_path, *LAYOUTS[name], model=plugin.GPT2, env=plugin.env())
    # Softmax ignores what the key bias adds (the same q·b for every key of a query): it gets no gradient.
    assert_matches(f"gpt2 {name}", reference, run, params, plugin.GPT2, unmoved=("attn.k.bias",))
    assert params["lm_head.weight"].equal(params["wte.weight"]), "the tied copies drifted apart"
