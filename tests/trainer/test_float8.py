"""float8 training (spec.training.float8) on the CPU: which linear layers are converted, that the converted
model trains like the bf16 one (torchao's emulation: the same casts and scales, the matmuls in high
precision), the device checks, and the planner's accounting. The float8 matmuls themselves run on the GPU
only (bench/gpu.py, docs/performance.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tetrad_trainer.config import ConfigError
from tetrad_trainer.models import llama as built_in
from tetrad_trainer.models.init import init_weights
from tetrad_trainer.parallelize import apply_float8, check_float8_device, float8_modules

from tests.trainer.harness import job
from tetrad.api.accelerators import ACCELERATORS
from tetrad.api.spec import Float8

Float8Linear = pytest.importorskip("torchao.float8.float8_linear").Float8Linear

LLAMA = job({}, nproc=1, model={"seqLen": 32, "layers": 2})
BLOCK_LINEARS = {f"layers.{i}.{name}" for i in range(2) for name in (
    "attention.wq", "attention.wk", "attention.wv", "attention.wo",
    "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}


def model(float8: Float8 | None) -> torch.nn.Module:
    m = built_in.definition.meta_model(LLAMA.model)
    if float8 is not None:
        assert apply_float8(m, float8, fsdp=False, emulate=True) is False  # no FSDP: no scales to precompute
    init_weights(m, torch.device("cpu"), seed=0)
    return m


def converted(m: torch.nn.Module) -> set[str]:
    return {fqn for fqn, mod in m.named_modules() if isinstance(mod, Float8Linear)}


def test_every_linear_layer_of_the_blocks_is_converted_and_the_output_only_when_chosen() -> None:
    assert converted(model(Float8(recipe="tensorwise"))) == BLOCK_LINEARS
    assert converted(model(Float8(recipe="rowwise", output=True))) == BLOCK_LINEARS | {"output"}
    assert float8_modules(built_in.definition.meta_model(LLAMA.model), Float8(recipe="tensorwise")) == sorted(
        BLOCK_LINEARS, key=list(dict(model(None).named_modules())).index)


def test_only_the_output_projection_itself_is_converted_not_a_module_whose_name_starts_like_it() -> None:
    m = built_in.definition.meta_model(LLAMA.model)
    with torch.device("meta"):
        m.output_head = torch.nn.Module()
        m.output_head.proj = torch.nn.Linear(64, 64)
    names = float8_modules(m, Float8(recipe="tensorwise", output=True))
    assert "output" in names and "output_head.proj" not in names


def test_a_layer_whose_dims_are_not_multiples_of_16_stays_in_bf16() -> None:
    odd = job({}, nproc=1, model={"seqLen": 32, "layers": 1, "ffnDim": 100})
    names = float8_modules(built_in.definition.meta_model(odd.model), Float8(recipe="tensorwise"))
    assert "layers.0.attention.wq" in names
    assert not any("feed_forward" in n for n in names)  # 100 is not a multiple of 16


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_converted_model_trains_like_the_plain_one(recipe: str) -> None:
    """Same initial weights (names unchanged), same batch: the losses of a few SGD steps agree to float8's
    rounding, and the converted model's loss falls."""
    plain, f8 = model(None), model(Float8(recipe=recipe))
    assert dict(plain.named_parameters()).keys() == dict(f8.named_parameters()).keys()
    tokens = torch.randint(0, LLAMA.model.vocab, (4, LLAMA.model.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    losses: dict[str, list[float]] = {"plain": [], "float8": []}
    for name, m in (("plain", plain), ("float8", f8)):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        for _ in range(4):
            loss = F.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    assert losses["float8"][-1] < losses["float8"][0] - 0.1, losses
    for a, b in zip(losses["plain"], losses["float8"], strict=True):
        assert abs(a - b) / a < 0.02, losses
    assert losses["plain"] != losses["float8"]  # the casts happened


def test_float8_on_a_cpu_names_the_field_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"spec.training.float8.recipe: float8 needs a CUDA GPU, this "
                                          r"process runs on cpu"):
        check_float8_device(torch.device("cpu"))


def test_the_planner_runs_float8_matmuls_at_the_float8_peak_and_refuses_a_gpu_without_one() -> None:
    from tetrad.api import parse
    from tetrad.plan.estimate import estimate
    from tetrad.plan.solver import predict_time, workload
    from tetrad.resolve import resolve, validate_document

    def document(recipe: str, gpu_type: str) -> dict:
        return {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob",
                "metadata": {"name": "f8"},
                "spec": {"nodes": 1, "nprocPerNode": 1, "parallelism": {"dpShard": 1},
                         "model": {"preset": "llama3-1b"}, "resources": {"gpu": 1, "gpuType": gpu_type},
                         "training": {"globalBatch": 4, "microBatch": 4, "compile": True,
                                      "float8": {"recipe": recipe}}}}

    assert ACCELERATORS["H100"].float8_tflops == pytest.approx(2 * ACCELERATORS["H100"].peak_tflops, rel=0.01)
    times, float8_flops = {}, {}
    for recipe in ("none", "tensorwise", "rowwise", "rowwise_with_gw_hp"):
        job_, problems = parse(document(recipe, "H100"))
        assert job_ is not None and not [p for p in problems if p.severity == "error"], problems
        resolved = resolve(job_)
        est = estimate(resolved.model, resolved.layout, workload(job_.spec, resolved.layout))
        float8_flops[recipe] = est.float8_flops
        times[recipe] = predict_time(job_.spec, resolved.model, est).total_s
    # rowwise's casts cost more than tensorwise's; rowwise_with_gw_hp's weight gradient (2 of 6) is bf16
    assert times["tensorwise"] < times["none"] < times["rowwise"], times
    assert float8_flops["none"] == 0 and float8_flops["tensorwise"] == float8_flops["rowwise"] > 0
    assert float8_flops["rowwise_with_gw_hp"] == pytest.approx(float8_flops["rowwise"] * 4 / 6)
    problems = validate_document(document("tensorwise", "A100"))
    assert any(p.field == "spec.training.float8.recipe" and "the A100 has no float8" in p.message
               for p in problems), problems
