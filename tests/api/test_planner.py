"""The auto-degree solver's rules and the planner's estimates."""

from __future__ import annotations

import pytest

from tests.api.helpers import manifest
from tetrad.api import InvalidJob, Layout, parse, resolve
from tetrad.api.presets import PRESETS
from tetrad.api.resolved import ModelConfig
from tetrad.api.spec import ActivationCheckpointing, Precision
from tetrad.plan.estimate import GiB, Workload, estimate

AUTO = {"dpReplicate": "auto", "dpShard": "auto", "tp": "auto", "cp": "auto", "pp": "auto"}


def solved(**spec):
    spec.setdefault("parallelism", AUTO)
    job, problems = parse(manifest(**spec))
    assert job is not None, problems
    return resolve(job).layout


def model(name):
    return ModelConfig(name=name, **PRESETS[name])


def test_small_model_gets_pure_fsdp():
    layout = solved(nodes=2, nprocPerNode=8, model={"preset": "llama3-8b"}, resources={"gpu": 8}, training={"globalBatch": 32})
    assert layout == Layout(dp_shard=16)


def test_tp_stays_inside_a_node():
    # one sample per DP rank at most: 64 processes with globalBatch 8 need 8-way model parallelism
    layout = solved(nodes=8, nprocPerNode=8, model={"preset": "llama3-8b"}, resources={"gpu": 8}, training={"globalBatch": 8})
    assert layout.tp <= 8 and layout.dp <= 8 and layout.world_size == 64


def test_pp_only_when_the_model_does_not_fit():
    # FSDP already shards weights, grads and optimizer over every rank, so PP stays off while the model fits
    assert solved(nodes=4, nprocPerNode=8, model={"preset": "llama3-70b", "seqLen": 4096}, resources={"gpu": 8},
                  training={"globalBatch": 32, "activationCheckpointing": "full"}).pp == 1
    # with the data-parallel degrees fixed to 1 (no FSDP), a 70B model needs pipeline stages on top of tp=8
    layout = solved(nodes=4, nprocPerNode=8, model={"preset": "llama3-70b", "seqLen": 4096}, resources={"gpu": 8},
                    parallelism={**AUTO, "dpShard": 1, "dpReplicate": "auto", "cp": 1},
                    training={"globalBatch": 8, "activationCheckpointing": "full"})
    assert layout.pp > 1 and layout.tp == 8


def test_nothing_fits_names_the_closest_layout():
    job, _ = parse(manifest(nodes=1, nprocPerNode=8, parallelism=AUTO, model={"preset": "llama3-70b"},
                            resources={"gpu": 8}, training={"globalBatch": 8, "activationCheckpointing": "full"}))
    with pytest.raises(InvalidJob, match=r"no layout fits 80 GiB .* the closest is pp\d"):
        resolve(job)


def test_cp_for_long_sequences():
    short = solved(nodes=1, nprocPerNode=8, model={"preset": "llama3-8b", "seqLen": 4096}, resources={"gpu": 8},
                   training={"globalBatch": 8, "activationCheckpointing": "full"})
    long = solved(nodes=1, nprocPerNode=8, model={"preset": "llama3-8b", "seqLen": 131072}, resources={"gpu": 8},
                  training={"globalBatch": 8, "activationCheckpointing": "full"})
    assert short.cp == 1 and long.cp > 1


def test_explicit_degrees_are_kept():
    job, _ = parse(manifest(parallelism={"pp": 2, "tp": 2, "dpShard": "auto"}))
    assert resolve(job).layout == Layout(pp=2, tp=2, dp_shard=2)


def test_memory_shrinks_with_sharding_and_checkpointing():
    m = model("llama3-8b")
    w = Workload(global_batch=16, micro_batch=1)
    one = estimate(m, Layout(dp_shard=1), w)
    eight = estimate(m, Layout(dp_shard=8), w)
    assert eight.params_bytes == pytest.approx(one.params_bytes / 8)
    assert eight.optimizer_bytes == pytest.approx(2 * eight.params_bytes)
    full = estimate(m, Layout(dp_shard=8), Workload(16, 1, ac=ActivationCheckpointing.FULL))
    sel = estimate(m, Layout(dp_shard=8), Workload(16, 1, ac=ActivationCheckpointing.SELECTIVE))
    assert full.activations_bytes < sel.activations_bytes < eight.activations_bytes
    assert full.hardware_flops == pytest.approx(eight.model_flops * 4 / 3)
    tp = estimate(m, Layout(dp_shard=4, tp=2), w)
    assert "tp" in tp.comm_bytes and tp.activations_bytes < eight.activations_bytes


def test_params_and_flops_match_known_sizes():
    assert model("llama3-8b").num_params() / 1e9 == pytest.approx(8.03, abs=0.01)
    assert model("llama3-70b").num_params() / 1e9 == pytest.approx(70.55, abs=0.05)
    m = model("llama3-8b")
    n = m.num_params(include_embedding=False)
    assert m.flops_per_token(2048) == pytest.approx(6 * n + 12 * 32 * 32 * 128 * 2048)


def test_total_flops_independent_of_layout():
    m = model("llama3-1b")
    w = Workload(global_batch=16, micro_batch=1, precision=Precision.BF16)
    a, b = estimate(m, Layout(dp_shard=8), w), estimate(m, Layout(dp_shard=2, tp=4), w)
    assert a.model_flops * 8 == pytest.approx(b.model_flops * 8)
    assert a.peak_bytes / GiB < 80
