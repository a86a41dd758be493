"""The model interface (tetrad_trainer.models) in one process: the built-in Llama and the GPT-2 example
(examples/bring-your-own/model) built on the meta device, initialized independently of the layout,
counted, split and sharded by the definition's names; the loader's errors."""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tetrad_trainer.config import ConfigError
from tetrad_trainer.models import ModelDefinition
from tetrad_trainer.models import llama as built_in
from tetrad_trainer.models.init import init_weights, initial_slice, initial_value
from tetrad_trainer.models.loader import checked_definition, definition_of, load_definition
from tetrad_trainer.parallelize import pipeline_split

from tests.trainer import plugin
from tests.trainer.harness import job, run_trainer
from tetrad.api.contract import EXIT_CONFIG_ERROR
from tetrad.api.presets import PRESETS

LLAMA = job({}, nproc=1, model={"seqLen": 32, "layers": 4})
GPT2 = job({}, nproc=1, model=plugin.GPT2)


@pytest.fixture(autouse=True)
def _importable() -> Iterator[None]:
    with plugin.importable():
        yield


def gpt2() -> ModelDefinition:
    return load_definition(plugin.GPT2["module"])


def build(definition: ModelDefinition, cfg, seed: int = 0) -> torch.nn.Module:
    model = definition.meta_model(cfg)
    init_weights(model, torch.device("cpu"), seed, definition=definition)
    return model


def test_the_built_in_llama_is_the_definition_of_a_job_without_module() -> None:
    assert load_definition(None) is built_in.definition
    assert checked_definition(LLAMA) is built_in.definition
    names = set(dict(built_in.definition.meta_model(LLAMA.model).named_parameters()))
    assert {"tok_embeddings.weight", "layers.3.attention.wq.weight", "layers.0.feed_forward.w2.weight",
            "norm.weight", "output.weight"} <= names


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_build_puts_every_parameter_on_the_meta_device(which: str) -> None:
    definition, cfg = (built_in.definition, LLAMA) if which == "llama" else (checked_definition(GPT2), GPT2)
    model = definition.meta_model(cfg.model)
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_gpt2_gives_logits_per_position_and_is_causal() -> None:
    cfg = GPT2.model
    model = build(gpt2(), cfg)
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq_len))
    changed = tokens.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % cfg.vocab
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, cfg.seq_len, cfg.vocab)
    assert torch.equal(a[:, :20], b[:, :20]) and not torch.allclose(a[:, 20:], b[:, 20:])


def test_tied_parameters_are_one_tensor_once_materialized() -> None:
    # to_empty gives each module its own parameter: init_weights ties them again
    model = build(gpt2(), GPT2.model)
    assert model.lm_head.weight is model.wte.weight
    all_names = dict(model.named_parameters(remove_duplicate=False))
    assert len(all_names) == len(list(model.parameters())) + 1
    model(torch.randint(0, 256, (1, 8))).sum().backward()
    assert model.lm_head.weight.grad is model.wte.weight.grad  # one gradient, both uses summed into it


@pytest.mark.parametrize("name", ["wte.weight", "lm_head.weight", "wpe.weight", "layers.2.attn.q.weight",
                                  "layers.1.mlp.proj.weight", "layers.0.attn.k.bias", "ln_f.weight"])
def test_gpt2_initial_values_are_the_same_in_every_box(name: str) -> None:
    cfg, definition = GPT2.model, gpt2()
    shape = tuple(definition.meta_model(cfg).get_parameter(name).shape)
    full = initial_value(name, torch.Size(shape), cfg, 5, definition)
    g = torch.Generator().manual_seed(len(name))
    for _ in range(10):
        start = [int(torch.randint(0, n, (1,), generator=g)) for n in shape]
        size = [int(torch.randint(0, n - s + 1, (1,), generator=g))
                for s, n in zip(start, shape, strict=True)]
        box = initial_slice(name, shape, start, size, cfg, 5, definition)
        assert torch.equal(box, full[tuple(slice(s, s + n)
                                           for s, n in zip(start, size, strict=True))]), (start, size)
    # Shards as FSDP and TP cut them (dim 0, either dim) reassemble the full value.
    for dim in range(len(shape)):
        bounds = [r * shape[dim] // 4 for r in range(5)]
        shards = [initial_slice(name, shape, [a if d == dim else 0 for d in range(len(shape))],
                                [b - a if d == dim else n for d, n in enumerate(shape)], cfg, 5, definition)
                  for a, b in zip(bounds, bounds[1:], strict=False)]
        assert torch.equal(torch.cat(shards, dim=dim), full)


def test_gpt2_init_follows_its_rule_and_a_tied_parameter_is_drawn_as_its_source() -> None:
    cfg, definition = GPT2.model, gpt2()
    model = build(definition, cfg, seed=3)
    for name, p in model.named_parameters(remove_duplicate=False):
        assert torch.equal(p, initial_value(name, p.shape, cfg, 3, definition)), name
    assert torch.equal(initial_value("lm_head.weight", torch.Size((256, 64)), cfg, 3, definition),
                       initial_value("wte.weight", torch.Size((256, 64)), cfg, 3, definition))
    assert torch.equal(model.layers["1"].ln_2.weight, torch.ones(64))
    assert not model.layers["1"].mlp.fc.bias.any()
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.layers["0"].attn.proj.weight.std().item() == pytest.approx(0.02 / 8**0.5, rel=0.1)
    assert not torch.equal(model.layers["0"].attn.q.weight, model.layers["0"].attn.k.weight)


def test_parameter_count_and_flops_per_token() -> None:
    cfg, definition = GPT2.model, gpt2()
    d, f, v, s, layers = cfg.dim, cfg.ffn_dim, cfg.vocab, cfg.seq_len, cfg.layers
    block = 2 * 2 * d + 4 * (d * d + d) + (d * f + f) + (f * d + d)  # 2 LayerNorms, q k v proj, fc, proj
    params = v * d + s * d + layers * block + 2 * d  # tied wte/lm_head once, wpe, blocks, ln_f
    assert definition.num_params(cfg) == params
    # 6N over the parameters of matmuls (the tied embedding is the output projection; wpe is a lookup only)
    assert (definition.flops_per_token(cfg)
            == 6 * (params - s * d) + 12 * layers * cfg.heads * (d // cfg.heads) * s)
    # The Llama definition gives the planner's closed forms, which counting its model gives too.
    counted = dataclasses.replace(built_in.definition, params=None, flops=None)
    for llama in (built_in.definition, counted):
        assert llama.num_params(LLAMA.model) == LLAMA.model.num_params()
        assert llama.flops_per_token(LLAMA.model) == LLAMA.model.flops_per_token()


def test_gpt2_pipeline_stages_compose_to_the_model_each_end_holding_a_copy_of_the_tie() -> None:
    definition = gpt2()
    model = build(definition, GPT2.model)
    stages = [pipeline_split(model, s, 2, definition) for s in range(2)]
    assert (stages[0].lm_head is None and stages[0].ln_f is None and stages[1].wte is None
            and stages[1].wpe is None)
    assert torch.equal(stages[1].lm_head.weight, model.wte.weight)
    tokens = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        assert torch.equal(stages[1](stages[0](tokens)), model(tokens))


def test_fsdp_puts_both_ends_of_a_tie_in_one_unit(one_rank_mesh) -> None:
    from tetrad_trainer.parallelize import apply_fsdp
    from torch.distributed.fsdp import OffloadPolicy

    from tetrad.api.spec import Precision

    model = gpt2().meta_model(GPT2.model)
    apply_fsdp(model, one_rank_mesh, Precision.FP32, reshard_after_forward=True, offload=OffloadPolicy())

    def unit_params(module: torch.nn.Module) -> set[int]:
        group = module._get_fsdp_state()._fsdp_param_group
        return {id(p.sharded_param) for p in group.fsdp_params} if group else set()

    assert model.lm_head.weight is model.wte.weight
    ends = {id(p) for m in (model.wte, model.wpe, model.ln_f, model.lm_head) for p in m.parameters()}
    assert unit_params(model.wte) == unit_params(model.lm_head) == ends
    assert unit_params(model) == set()


# --- the loader ----------------------------------------------------------------------------------------

BAD = '''
    import dataclasses
    import gpt2_model

    no_blocks = dataclasses.replace(gpt2_model.definition, blocks="h")
    wrong_names = dataclasses.replace(gpt2_model.definition, first_stage=("embed",), output="head",
                                      attention="attn.kernel", tied=(("wte.weight", "ln_f.weight"),))
    no_parallel_plans = dataclasses.replace(gpt2_model.definition, tensor_parallel=None, attention=None)
    fails = dataclasses.replace(gpt2_model.definition, build=lambda cfg: 1 / 0)
    reversed_tie = dataclasses.replace(gpt2_model.definition, tied=(("lm_head.weight", "wte.weight"),))
    '''


def module_job(module: str, **parallelism: int):
    return job(parallelism, nproc=max(1, parallelism.get("tp", 1) * parallelism.get("cp", 1)),
               model={**plugin.GPT2, "module": module})


@pytest.mark.parametrize("module, message", [
    ("nope_mod:definition", "cannot import nope_mod: ModuleNotFoundError: No module named 'nope_mod'"),
    ("broken:definition", "cannot import broken: RuntimeError: this plug-in does not import"),
    ("gpt2_model:nothing", "module gpt2_model has no attribute 'nothing'"),
    ("gpt2_model:GPT2", "gpt2_model.GPT2 is a type, not a tetrad_trainer.models.ModelDefinition"),
    ("gpt2_model:initial_values",
     "gpt2_model.initial_values is a function, not a tetrad_trainer.models.ModelDefinition"),
])
def test_a_module_that_is_no_definition_is_a_config_error_naming_the_field(
        module: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken.py").write_text("raise RuntimeError('this plug-in does not import')\n")
    monkeypatch.syspath_prepend(tmp_path)
    with pytest.raises(ConfigError) as e:
        checked_definition(module_job(module))
    assert str(e.value) == f"spec.model.module={module}: {message}"
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name, parallelism, messages", [
    ("no_blocks", {},
     ["ModelDefinition.blocks='h': the model needs a ModuleDict of that name keyed '0'..'3'"]),
    ("wrong_names", {}, ["the model has no top-level module 'embed'",
                         "ModelDefinition.output='head' is not among last_stage",
                         "parameters of ['wpe', 'wte'] belong to no pipeline stage",
                         "ModelDefinition.attention='attn.kernel' is not a module of a block",
                         "tied ('wte.weight', 'ln_f.weight') are two tensors"]),
    ("no_parallel_plans", {"tp": 2, "cp": 2}, ["spec.parallelism.tp=2 needs a tensor-parallel plan",
                                               "spec.parallelism.cp=2 needs the blocks' attention core"]),
    ("fails", {}, ["build(bad_defs:fails) failed: ZeroDivisionError: division by zero"]),
    ("reversed_tie", {}, ["tied ('lm_head.weight', 'wte.weight'): name the first stage's end first"]),
])
def test_a_definition_whose_model_lacks_what_it_names_is_a_config_error(
        name: str, parallelism: dict[str, int], messages: list[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bad_defs.py").write_text(textwrap.dedent(BAD))
    monkeypatch.syspath_prepend(tmp_path)
    with pytest.raises(ConfigError) as e:
        checked_definition(module_job(f"bad_defs:{name}", **parallelism))
    assert str(e.value).startswith(f"spec.model.module=bad_defs:{name}: ")
    for message in messages:
        assert message in str(e.value)


@pytest.mark.distributed
def test_the_trainer_exits_78_on_every_rank_for_a_module_that_does_not_import(tmp_path: Path) -> None:
    run = run_trainer(module_job("nope_mod:definition").model_copy(update={"nproc_per_node": 2}), tmp_path,
                      env=plugin.env())
    assert run.codes == [EXIT_CONFIG_ERROR] * 2, run.logs()
    for rank in (0, 1):  # checked before any collective: no rank waits for the other
        assert ("config error: spec.model.module=nope_mod:definition: cannot import nope_mod: "
                "ModuleNotFoundError: No module named 'nope_mod'") in run.log(rank)


def tied_llama() -> ModelDefinition:
    """Llama 3.2's tied embedding, as a few lines over the built-in definition."""

    def build(cfg):
        model = built_in.Transformer(cfg)
        model.output.weight = model.tok_embeddings.weight
        return model

    return dataclasses.replace(built_in.definition, build=build,
                               tied=(("tok_embeddings.weight", "output.weight"),), params=None, flops=None)


@pytest.mark.parametrize("which", ["gpt2", "tied-llama"])
def test_tensor_parallelism_keeps_a_tie_both_ends_sharded_on_the_vocab(which: str, one_rank_mesh) -> None:
    from tetrad_trainer.parallelize import apply_tp
    from torch.distributed.tensor import DTensor, Shard

    definition, cfg = (gpt2(), GPT2.model) if which == "gpt2" else (tied_llama(), LLAMA.model)
    (a, b), = definition.tied
    model = definition.meta_model(cfg)
    apply_tp(model, one_rank_mesh, definition)
    assert model.get_parameter(a) is model.get_parameter(b)
    assert isinstance(model.get_parameter(a), DTensor) and model.get_parameter(a).placements == (Shard(0),)
    init_weights(model, torch.device("cpu"), 0, definition=definition)
    assert model.get_parameter(a) is model.get_parameter(b)


def test_a_tied_llama_counts_its_embedding_once_and_keeps_the_llama_names() -> None:
    definition = tied_llama()
    model = build(definition, LLAMA.model)
    assert model.output.weight is model.tok_embeddings.weight
    assert (definition.num_params(LLAMA.model)
            == LLAMA.model.num_params() - LLAMA.model.vocab * LLAMA.model.dim)
    # the output still multiplies
    assert definition.flops_per_token(LLAMA.model) == LLAMA.model.flops_per_token()


@pytest.mark.parametrize("preset", list(PRESETS))
def test_the_planners_counts_are_those_of_the_built_model_for_every_family(preset: str) -> None:
    """ModelConfig's closed forms (the planner's, the MFU's) against counting the built model: head_dim apart
    from dim/heads (Qwen3), q/k/v biases (Qwen2.5), q/k norms (Qwen3), a tied embedding counted once."""
    cfg = job({}, nproc=1, model={"preset": preset}).model
    counted = dataclasses.replace(definition_of(cfg), params=None, flops=None)
    assert cfg.num_params() == counted.num_params(cfg)
    assert cfg.flops_per_token() == pytest.approx(counted.flops_per_token(cfg), rel=1e-12)


def test_a_models_options_choose_its_definition() -> None:
    """Qwen3's per-head norms join the TP plan, a tie the definition's tied pairs; without them the
    Llama's."""
    qwen3 = job({}, nproc=1, model={"preset": "qwen3-0.6b", "layers": 2, "seqLen": 32})
    definition = checked_definition(qwen3)
    assert definition.tied == (("tok_embeddings.weight", "output.weight"),)
    assert {"attention.q_norm", "attention.k_norm"} <= set(definition.tensor_parallel.block)
    assert checked_definition(job({}, nproc=1, model={"preset": "qwen2.5-7b", "layers": 2, "seqLen": 32})) \
        is built_in.definition


def test_tensor_parallel_q_k_norms_are_replicated_and_act_per_head(one_rank_mesh) -> None:
    """Under TP the q/k norms' weights are replicated DTensors (their gradient summed over the tp ranks) and
    the sharded heads reach them as local tensors: the parallel model computes the plain one's logits."""
    from tetrad_trainer.parallelize import apply_tp
    from torch.distributed.tensor import DTensor, Replicate, Shard

    cfg = job({}, nproc=1, model={"family": "qwen3", "dim": 64, "heads": 4, "kvHeads": 2, "headDim": 32,
                                  "layers": 2, "vocab": 128, "seqLen": 16}).model
    definition = definition_of(cfg)
    plain, parallel = build(definition, cfg, seed=3), definition.meta_model(cfg)
    apply_tp(parallel, one_rank_mesh, definition)
    init_weights(parallel, torch.device("cpu"), 3, definition=definition)
    q_norm = parallel.layers["0"].attention.q_norm.weight
    assert isinstance(q_norm, DTensor) and q_norm.placements == (Replicate(),)
    assert parallel.layers["0"].attention.wq.bias is None
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq_len))
    with torch.no_grad():
        logits = parallel(tokens)
    assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
    torch.testing.assert_close(logits.full_tensor(), plain(tokens), rtol=1e-6, atol=1e-6)
    plain(tokens).sum().backward()
    assert plain.layers["0"].attention.q_norm.weight.grad.abs().sum() > 0
