"""The model, its deterministic initialization and the pipeline split, in one process."""

from __future__ import annotations

import pytest
import torch
from tetrad_trainer.cp import shard_sequence
from tetrad_trainer.model import (
    Transformer,
    apply_rope,
    canonical_name,
    init_weights,
    initial_slice,
    initial_value,
    rope_tables,
)
from tetrad_trainer.models.llama import rope_real
from tetrad_trainer.parallelize import pipeline_split, stage_ids, stage_layers

from tests.trainer.harness import job
from tetrad.api.spec import PPSchedule

CFG = job({}, nproc=1, model={"seqLen": 32, "layers": 4}).model


def build(seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(CFG)
    init_weights(model, torch.device("cpu"), seed)
    return model


def test_forward_gives_logits_per_position_and_parameter_count_matches_the_api() -> None:
    model = build()
    tokens = torch.randint(0, CFG.vocab, (2, CFG.seq_len))
    assert model(tokens).shape == (2, CFG.seq_len, CFG.vocab)
    assert sum(p.numel() for p in model.parameters()) == CFG.num_params()


def test_attention_is_causal() -> None:
    model = build()
    tokens = torch.randint(0, CFG.vocab, (1, CFG.seq_len))
    changed = tokens.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % CFG.vocab
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[0, :20], b[0, :20])
    assert not torch.allclose(a[0, 20:], b[0, 20:])


def test_initialization_is_a_function_of_seed_and_name_only() -> None:
    a, b, c = build(seed=1), build(seed=1), build(seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        assert torch.equal(pa, initial_value(name, pa.shape, CFG, 1)), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    # Different tensors of the same shape get different values.
    assert not torch.equal(a.layers["0"].attention.wk.weight, a.layers["0"].attention.wv.weight)
    assert not torch.equal(a.layers["0"].attention.wq.weight, a.layers["1"].attention.wq.weight)


def test_init_statistics_follow_the_recipe() -> None:
    m = build()
    assert torch.equal(m.layers["2"].ffn_norm.weight, torch.ones(CFG.dim))
    assert m.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.05)
    # truncated at 2 std
    assert m.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.02 * 0.88, rel=0.1)
    # Residual-branch outputs shrink with depth.
    assert m.layers["3"].attention.wo.weight.std() < m.layers["0"].attention.wo.weight.std()


def test_canonical_name_strips_wrapper_prefixes() -> None:
    assert (canonical_name("layers.3._orig_mod._checkpoint_wrapped_module.attention.wq.weight")
            == "layers.3.attention.wq.weight")


@pytest.mark.parametrize("rotate", [apply_rope, rope_real], ids=["complex", "real"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_each_consecutive_pair_by_its_positions_angle(dtype: torch.dtype, rotate) -> None:
    """The rotation as complex numbers: pair (a, b) of frequency i at position p is (a + ib) e^(i p f_i),
    computed in fp32 and cast back to the input's dtype; eager (complex) and compiled (real) forms alike."""
    head_dim, theta, positions = 16, 10_000.0, torch.arange(6) + 3
    x = torch.randn(2, 6, 3, head_dim).to(dtype)
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    turn = torch.polar(torch.ones(6, head_dim // 2, dtype=torch.float64), positions[:, None] * freqs[None, :])
    pairs = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    expected = torch.view_as_real(pairs * turn[None, :, None, :]).flatten(-2)
    rotated = rotate(x, rope_tables(head_dim, theta, positions))
    assert rotated.dtype == dtype
    torch.testing.assert_close(rotated.double(), expected, rtol=0,
                               atol=1e-6 if dtype == torch.float32 else 2e-2)


def test_rope_eager_and_compiled_rotate_and_differentiate_alike() -> None:
    """A table longer than the sequence (the model's is seqLen long), gradients through both forms, and
    apply_rope under torch.compile taking the real form (no complex tensors in the traced graph)."""
    graphs: list[str] = []

    def recording(gm: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(gm.code)
        return gm.forward

    rope = rope_tables(8, 500.0, torch.arange(10))
    x = torch.randn(2, 7, 3, 8, requires_grad=True)
    grad = torch.randn(2, 7, 3, 8)
    outs, grads = [], []
    for rotate in (apply_rope, rope_real, torch.compile(apply_rope, backend=recording, fullgraph=True)):
        out = rotate(x, rope)
        out.backward(grad)
        outs.append(out.detach())
        grads.append(x.grad)
        x.grad = None
    for out, g in zip(outs[1:], grads[1:], strict=True):
        torch.testing.assert_close(out, outs[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(g, grads[0], rtol=0, atol=1e-6)
    assert len(graphs) == 1 and "flip" in graphs[0] and "complex" not in graphs[0]


def test_rope_follows_the_context_parallel_positions() -> None:
    model = build()
    model.set_positions(shard_sequence(torch.arange(CFG.seq_len), 0, 2, 1))
    model.init_buffers()
    full = build().rope
    assert torch.equal(model.rope, shard_sequence(full, 0, 2, 1))


@pytest.mark.parametrize("layers, stages, expected", [
    (4, 2, [[0, 1], [2, 3]]),  # embedding+2 blocks | 2 blocks+output
    (4, 4, [[0], [1, 2], [3], []]),  # 6 units over 4 stages: the last holds only the output
    (2, 4, [[], [0], [1], []]),
    (16, 3, [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]),
])
def test_stage_layers_count_embedding_and_output_as_layers(layers: int, stages: int,
                                                           expected: list[list[int]]) -> None:
    split = stage_layers(layers, stages)
    assert split == expected
    assert sum(split, []) == list(range(layers))


def test_stage_ids_loop_or_v_shape() -> None:
    assert stage_ids(PPSchedule.INTERLEAVED_1F1B, 2, 1, 2) == [1, 3]
    assert stage_ids(PPSchedule.ZERO_BUBBLE, 2, 1, 2) == [1, 2]
    assert stage_ids(PPSchedule.ONE_F_ONE_B, 4, 3, 1) == [3]


def test_pipeline_stages_keep_the_full_models_names_and_compose_to_it() -> None:
    model = build()
    stages = [pipeline_split(model, s, 2) for s in range(2)]
    names = [set(dict(s.named_parameters())) for s in stages]
    assert not names[0] & names[1]
    assert names[0] | names[1] == set(dict(model.named_parameters()))
    assert stages[0].output is None and stages[1].tok_embeddings is None
    tokens = torch.randint(0, CFG.vocab, (2, CFG.seq_len))
    with torch.no_grad():
        assert torch.equal(stages[1](stages[0](tokens)), model(tokens))


@pytest.mark.parametrize("layout, style", [
    ({"dp_replicate": 2}, "ddp"),
    ({"dp_replicate": 2, "tp": 2}, "replicate"),
    ({"dp_replicate": 2, "pp": 2}, "replicate"),
    ({"dp_shard": 2}, "fsdp"),
    # CP ranks hold the same parameters: FSDP over dp_shard x cp averages their gradients
    ({"cp": 2}, "fsdp"),
    ({"dp_replicate": 2, "dp_shard": 2}, "fsdp"),  # HSDP
    ({"tp": 2, "pp": 2}, None),
])
def test_data_parallel_style_per_layout(layout: dict[str, int], style: str | None) -> None:
    from tetrad_trainer.parallelize import data_parallel_style

    from tetrad.api import Layout

    assert data_parallel_style(Layout(**layout)) == style


def test_fsdp_gives_the_embedding_and_the_output_units_of_their_own(one_rank_mesh) -> None:
    from tetrad_trainer.parallelize import apply_fsdp
    from torch.distributed.fsdp import FSDPModule, OffloadPolicy

    from tetrad.api.spec import Precision

    with torch.device("meta"):
        model = Transformer(CFG)
    apply_fsdp(model, one_rank_mesh, Precision.FP32, reshard_after_forward=True, offload=OffloadPolicy())

    def unit_params(module: torch.nn.Module) -> set[int]:
        group = module._get_fsdp_state()._fsdp_param_group
        return {id(p.sharded_param) for p in group.fsdp_params} if group else set()

    assert all(isinstance(m, FSDPModule)
               for m in (model, model.tok_embeddings, model.output, *model.layers.values()))
    assert unit_params(model.tok_embeddings) == {id(model.tok_embeddings.weight)}
    assert unit_params(model.output) == {id(model.output.weight), id(model.norm.weight)}
    assert unit_params(model) == set()  # the root holds nothing: every parameter sits in a smaller unit


@pytest.mark.parametrize("name, shape", [
    ("output.weight", (700, 2500)),  # several tiles each way, ragged last tiles
    ("layers.1.feed_forward.w2.weight", (300, 1030)),
    ("tok_embeddings.weight", (513, 64)),
    ("layers.0.attention_norm.weight", (3000,)),
])
def test_any_box_of_a_parameter_equals_that_box_of_its_full_value(name: str, shape: tuple[int, ...]) -> None:
    full = initial_value(name, torch.Size(shape), CFG, 5)
    g = torch.Generator().manual_seed(len(name))
    for _ in range(20):
        start = [int(torch.randint(0, n, (1,), generator=g)) for n in shape]
        size = [int(torch.randint(0, n - s + 1, (1,), generator=g))
                for s, n in zip(start, shape, strict=True)]
        box = initial_slice(name, shape, start, size, CFG, 5)
        assert torch.equal(box, full[tuple(slice(s, s + n)
                                           for s, n in zip(start, size, strict=True))]), (start, size)
    # Even shards, as FSDP on dim 0 and TP on either dim cut them, reassemble the full value.
    if len(shape) == 2:
        bounds = [r * shape[0] // 4 for r in range(5)]
        rows = [initial_slice(name, shape, [a, 0], [b - a, shape[1]], CFG, 5)
                for a, b in zip(bounds, bounds[1:], strict=False)]
        assert torch.equal(torch.cat(rows), full)


def test_initial_values_differ_across_tiles_and_names() -> None:
    w = initial_value("output.weight", torch.Size((512, 2048)), CFG, 0)
    tiles = [w[i:i + 256, j:j + 1024] for i in (0, 256) for j in (0, 1024)]
    assert all(not torch.equal(a, b) for k, a in enumerate(tiles) for b in tiles[k + 1:])
    assert not torch.equal(w, initial_value("layers.0.attention.wq.weight", torch.Size((512, 2048)), CFG, 0))
