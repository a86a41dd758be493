"""Every family against transformers' own implementation, from Hugging Face directories a new user would have.

Each directory is built by `transformers` from the published config.json values of a real checkpoint
(tests/hf_configs.py: layers shrunk, every arithmetic feature kept), with random weights perturbed so
no norm weight or bias is trivial, and the published-style config.json (Llama 2 without rope_theta,
Llama 3.1's rope_scaling, ...), a tokenizer and a generation config beside it. Then:

- Tetrad imports it, and its fp32 logits are within 1e-5 (relative to the largest logit) of a float64
  run of transformers' model whose RoPE tables are transformers' own formulas evaluated in float64,
  at positions 0.., past 8192 (Llama 3.1's scaling threshold) and near 30000, where transformers' fp32
  RoPE itself is off by up to 1e-3; at position 0 also of transformers' fp32 run;
- the same check fails by orders of magnitude without the q/k row permutation, without the q/k norms'
  permutation, without Qwen3's q/k norms, Qwen2's biases or Llama 3.1's scaling: the test can tell;
- imported and exported again, the directory's tensors come back bit for bit (fp32 and bf16), with its
  config keys, tokenizer and generation config; a sharded export loads in transformers with the same logits;
- the trainer (gloo) started from the directory logs transformers' loss on the same batch as its first
  loss, tp2, dpShard2 and pp2 log the same, and its checkpoint exports to a directory transformers loads with
  the trained model's logits and Tetrad imports bit for bit;
- a pipelined run's checkpoint resumed by dpShard2 ends where the uninterrupted run did.
"""

from __future__ import annotations

import copy
import json
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file
from tetrad_trainer import export as hf
from tetrad_trainer.data import BatchLoader, build_source
from tetrad_trainer.models.llama import Transformer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tests.hf_configs import PUBLISHED, shrunk
from tests.trainer.harness import job, rewind, run_trainer
from tetrad.api.contract import EXIT_CONFIG_ERROR
from tetrad.api.families import read_hf_config
from tetrad.api.resolved import ModelConfig

TOLERANCE = 1e-5  # max |ours - reference| / max |reference|, fp32 against float64
STARTS = (0, 9000, 30000)  # first positions of the compared windows: Llama 3.1 scales RoPE past 8192
WINDOW = 16
# one per family, with each feature: scaling, tying (Llama 3.2, SmolLM2, Qwen2.5-0.5B), biases, q/k norms
TRAINED = ("llama3.1-8b", "llama3.2-1b", "mistral-7b", "qwen2.5-0.5b", "qwen3-0.6b", "smollm2-135m")


def build_hf_dir(name: str, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A Hugging Face directory of the shrunk published config `name`, as transformers writes it, with the
    published-style config.json, a tokenizer and a generation config."""
    published = shrunk(PUBLISHED[name])
    config = transformers.AutoConfig.for_model(published["model_type"],  # it edits the dicts it is given
                                               **{k: v for k, v in copy.deepcopy(published).items()
                                                  if k != "model_type"})
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # norms and biases away from 1 and 0
            p.add_(torch.randn_like(p) * 0.05)
    model.to(dtype).save_pretrained(out)
    (out / "config.json").write_text(json.dumps({**published,
                                                 "torch_dtype": str(dtype).removeprefix("torch.")}))
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = published["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                         eos_token="t2").save_pretrained(out)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=[2, 3], do_sample=True, temperature=0.6,
                                  top_p=0.9).save_pretrained(out)
    return out


_DIRS: dict[tuple[str, torch.dtype], Path] = {}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    def get(name: str, dtype: torch.dtype = torch.float32) -> Path:
        if (name, dtype) not in _DIRS:
            _DIRS[name, dtype] = build_hf_dir(name, tmp_path_factory.mktemp(name.replace(".", "_")), dtype)
        return _DIRS[name, dtype]
    return get


def model_config(d: Path, seq_len: int = WINDOW, **spec: Any) -> ModelConfig:
    """The resolved model of a job whose spec.model is the directory's config.json fields (as the CLI fills
    it)."""
    fields = read_hf_config(json.loads((d / "config.json").read_text())).fields
    return job({}, nproc=1, model={**fields, "hfDir": str(d), "seqLen": seq_len, **spec}).model


def tetrad_model(d: Path, cfg: ModelConfig | None = None) -> Transformer:
    cfg = cfg or model_config(d)
    model = Transformer(cfg)
    hf.init_from_hf([model], d, cfg)  # the trainer's import path
    return model.eval()


class _Float64Torch:
    """torch, but `torch.float` is float64: transformers' RoPE formulas run unchanged in double precision."""

    float = torch.float64

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def float64_reference(d: Path) -> transformers.PreTrainedModel:
    """transformers' model in float64, its RoPE tables from its own formula (default or llama3) in float64:
    its fp32 tables (angles rounded at large positions) are the largest error of its fp32 run."""
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64,
                                                              attn_implementation="eager").eval()
    rotary = model.model.rotary_emb
    fn = (type(rotary).compute_default_rope_parameters if rotary.rope_type == "default"
          else ROPE_INIT_FUNCTIONS[rotary.rope_type])
    fn64 = types.FunctionType(fn.__code__, {**fn.__globals__, "torch": _Float64Torch()}, fn.__name__,
                              fn.__defaults__, fn.__closure__)
    inv_freq, scale = fn64(model.config)
    assert inv_freq.dtype == torch.float64

    def forward(x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids[..., None].double() * inv_freq
        emb = torch.cat((angles, angles), dim=-1)
        return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)

    rotary.forward = forward
    return model


def transformers_fp32(d: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@torch.no_grad()
def logits_error(model: Transformer, reference: transformers.PreTrainedModel, start: int) -> float:
    tokens = torch.randint(0, model.cfg.vocab, (2, WINDOW), generator=torch.Generator().manual_seed(start))
    positions = torch.arange(start, start + WINDOW)
    model.set_positions(positions)
    return relative(model(tokens), reference(tokens, position_ids=positions.expand(2, -1)).logits)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_logits_match_transformers_past_the_scaling_threshold(name: str, hf_dir: Callable[..., Path]) -> None:
    d = hf_dir(name)
    model, exact, fp32 = tetrad_model(d), float64_reference(d), transformers_fp32(d)
    errors = {start: logits_error(model, exact, start) for start in STARTS}
    theirs = {start: logits_error_of(fp32, exact, start, model.cfg.vocab) for start in STARTS}
    print(f"\n[families] {name:14s} ours vs float64 {max(errors.values()):.1e}; transformers fp32 vs "
          f"float64 at {STARTS[-1]}: {theirs[STARTS[-1]]:.1e}")
    assert max(errors.values()) < TOLERANCE, errors
    assert logits_error(model, fp32, 0) < TOLERANCE  # at small positions transformers' fp32 agrees too
    assert theirs[STARTS[-1]] > 10 * errors[STARTS[-1]], ("the float64 reference must be the better one out "
                                                          "there")


@torch.no_grad()
def logits_error_of(model: transformers.PreTrainedModel, reference: transformers.PreTrainedModel, start: int,
                    vocab: int) -> float:
    tokens = torch.randint(0, vocab, (2, WINDOW), generator=torch.Generator().manual_seed(start))
    positions = torch.arange(start, start + WINDOW).expand(2, -1)
    return relative(model(tokens, position_ids=positions).logits,
                    reference(tokens, position_ids=positions).logits)


def _no_permutation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf, "to_interleaved_rope", lambda w, heads: w)


def _no_norm_permutation(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = {k: v for k, v in hf._ROPE_ROWS.items() if "norm" not in k}
    monkeypatch.setattr(hf, "_ROPE_ROWS", rows)


SABOTAGE: dict[str, tuple[str, Callable[[pytest.MonkeyPatch], None] | None, dict[str, Any]]] = {
    # what is wrong: (directory, conversion patch, model option changed after the import)
    "q/k rows not permuted": ("llama3.1-8b", _no_permutation, {}),
    "q/k norm weights not permuted": ("qwen3-0.6b", _no_norm_permutation, {}),
    "no q/k norms": ("qwen3-0.6b", None, {"qk_norm": False}),
    "no q/k/v biases": ("qwen2.5-7b", None, {"qkv_bias": False}),
    "no llama3 RoPE scaling": ("llama3.1-8b", None, {"rope_scaling": None}),
}


@pytest.mark.parametrize("what", list(SABOTAGE))
def test_a_wrong_conversion_or_a_missing_feature_fails_the_check(what: str, hf_dir: Callable[..., Path],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The conformance check can tell: each mistake puts the logits far outside the tolerance."""
    name, patch, option = SABOTAGE[what]
    d = hf_dir(name)
    if patch is not None:
        patch(monkeypatch)
    model = tetrad_model(d)
    if option:
        wrong = Transformer(model.cfg.model_copy(update=option))
        wrong.load_state_dict(model.state_dict(), strict=False)  # every tensor the wrong model has
        model = wrong.eval()
    error = max(logits_error(model, float64_reference(d), start) for start in STARTS)
    print(f"\n[families] {what}: {error:.1e}")
    assert error > 100 * TOLERANCE


def hf_tensors(d: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.mark.parametrize("name, dtype", [*((n, torch.float32) for n in PUBLISHED),
                                         ("qwen3-8b", torch.bfloat16), ("llama3.2-1b", torch.bfloat16)])
def test_import_then_export_gives_back_the_directory_bit_for_bit(name: str, dtype: torch.dtype,
                                                                 hf_dir: Callable[..., Path],
                                                                 tmp_path: Path) -> None:
    d = hf_dir(name, dtype)
    cfg = model_config(d)
    params = hf.import_hf(d, cfg)
    hf.save_hf(params, cfg, tmp_path, source=d)  # the source's dtype by default
    source, exported = hf_tensors(d), hf_tensors(tmp_path)
    assert exported.keys() == source.keys()  # a tied model has no lm_head, as transformers writes it
    for k, want in source.items():
        assert exported[k].dtype == want.dtype and torch.equal(exported[k], want), k
    back = hf.import_hf(tmp_path, cfg)
    assert all(torch.equal(back[k], v) for k, v in params.items())
    written, original = (json.loads((x / "config.json").read_text()) for x in (tmp_path, d))
    assert ({k: written[k] for k in original if k != "rope_theta"}
            == {k: v for k, v in original.items() if k != "rope_theta"})
    assert written["rope_theta"] == original.get("rope_theta", 10000.0)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / f).read_bytes() == (d / f).read_bytes(), f


def test_a_large_export_is_sharded_with_an_index_transformers_loads(hf_dir: Callable[..., Path],
                                                                    tmp_path: Path) -> None:
    d = hf_dir("qwen3-8b")
    cfg = model_config(d)
    params = hf.import_hf(d, cfg)
    hf.save_hf(params, cfg, tmp_path, source=d, max_shard_bytes=4 << 20)
    index = json.loads((tmp_path / hf.INDEX).read_text())
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files) and hf.WEIGHTS not in files
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in hf_tensors(d).values())
    loaded = transformers_fp32(tmp_path)
    assert logits_error_of(loaded, transformers_fp32(d), 0, cfg.vocab) == 0.0
    assert all(torch.equal(hf.import_hf(tmp_path, cfg)[k], v) for k, v in params.items())
    hf.save_hf(params, cfg, tmp_path, source=d)  # exported again, unsharded: no stale shard or index left
    assert sorted(p.name for p in tmp_path.glob("model*")) == [hf.WEIGHTS]


# -- the trainer ------------------------------------------------------------------------------------

SEQ = 32
TRAINING = {"steps": 1, "globalBatch": 4, "precision": "fp32", "lr": 1e-3, "warmupSteps": 0, "seed": 3}


def trainer_job(d: Path, parallelism: dict[str, Any], nproc: int, steps: int = 1, **spec: Any) -> Any:
    fields = read_hf_config(json.loads((d / "config.json").read_text())).fields
    return job({"dpShard": 1, **parallelism}, nproc=nproc, model={**fields, "hfDir": str(d), "seqLen": SEQ},
               training={**TRAINING, "steps": steps}, **spec)


def first_loss(run: Any) -> float:
    (record,) = run.records
    return float(record["loss"])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED)
def test_the_trainer_starts_from_the_directory_with_transformers_loss_and_exports_it(
        name: str, hf_dir: Callable[..., Path], tmp_path: Path) -> None:
    d = hf_dir(name)
    ckpt = tmp_path / "ckpt"
    cfg = trainer_job(d, {}, 1, checkpoint={"enabled": True, "path": str(ckpt), "interval": 100})
    run = run_trainer(cfg, tmp_path / "one", args=("--save-full-parameters", str(tmp_path / "p.pt")))
    assert run.codes == [0], run.logs()
    assert f"initial weights from the Hugging Face model {d}" in run.log(0)

    inputs, labels = BatchLoader(build_source(cfg), cfg.training.global_batch, dp_rank=0,
                                 dp_size=1).next_batch()
    with torch.no_grad():
        logits = transformers_fp32(d)(inputs).logits
    theirs = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).item()
    ours = first_loss(run)
    print(f"\n[families] {name}: first loss {ours:.6f}, transformers {theirs:.6f}")
    assert ours == pytest.approx(theirs, rel=1e-5)

    # pp2: a tied output's stage reads the embedding
    for parallelism in ({"tp": 2}, {"dpShard": 2}, {"pp": 2}):
        other = run_trainer(trainer_job(d, parallelism, 2), tmp_path / next(iter(parallelism)))
        assert other.codes == [0, 0], other.logs()
        assert first_loss(other) == pytest.approx(ours, rel=1e-5), parallelism

    # the checkpoint of the trained step, exported (config and tokenizer from the copy kept beside it)
    assert (ckpt / hf.SOURCE_DIR / "tokenizer.json").is_file()
    out = tmp_path / "export"
    assert hf.main([str(ckpt), str(out)]) == 0
    trained = torch.load(tmp_path / "p.pt")
    model = Transformer(cfg.model)
    model.load_state_dict(trained)
    exported = transformers_fp32(out)
    assert logits_error(model.eval(), exported, 0) < TOLERANCE  # two fp32 implementations of the same weights
    back = hf.import_hf(out, cfg.model)
    assert all(torch.equal(back[k], trained[k]) for k in back)
    tokenizers = [transformers.AutoTokenizer.from_pretrained(x) for x in (out, d)]
    # transformers picks the same tokenizer class
    assert tokenizers[0]("t5 t7 t9") == tokenizers[1]("t5 t7 t9")
    assert (out / "tokenizer.json").read_bytes() == (d / "tokenizer.json").read_bytes()
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == [2, 3]
    assert (json.loads((out / "config.json").read_text())["eos_token_id"]
            == PUBLISHED[name]["eos_token_id"] % 512)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED)
def test_a_run_resumed_in_another_layout_ends_where_the_uninterrupted_one_did(
        name: str, hf_dir: Callable[..., Path], tmp_path: Path) -> None:
    """Four steps pipelined (a tied embedding held by both ends' stages) with checkpoints at 2 and 4; the
    checkpoint of step 2 resumed by dpShard2 (one parameter) trains steps 3 and 4 to the same losses and
    parameters, within the reduction order's noise. The checkpoint, not the directory, gives the weights."""
    d = hf_dir(name)
    ckpt = tmp_path / "ckpt"
    checkpoint = {"enabled": True, "path": str(ckpt), "interval": 2}
    runs, params = {}, {}
    for label, parallelism in (("straight", {"pp": 2}), ("resumed", {"dpShard": 2})):
        if label == "resumed":
            rewind(ckpt, 2)
        runs[label] = run_trainer(trainer_job(d, parallelism, 2, steps=4, checkpoint=checkpoint),
                                  tmp_path / label,
                                  args=("--save-full-parameters", str(tmp_path / f"{label}.pt")))
        assert runs[label].codes == [0, 0], runs[label].logs()
        params[label] = torch.load(tmp_path / f"{label}.pt")
    assert "resumed step 2" in runs["resumed"].log(0)
    assert [r["step"] for r in runs["resumed"].records] == [3, 4]
    assert [r["loss"] for r in runs["resumed"].records] == pytest.approx(
        [r["loss"] for r in runs["straight"].records[2:]], rel=1e-5)
    want, got = params["straight"], params["resumed"]
    assert got.keys() == want.keys()
    assert max((want[k] - got[k]).abs().max().item() for k in want) < 1e-5


@pytest.mark.distributed
def test_a_directory_the_trainer_cannot_train_exits_78_on_every_rank_naming_the_key(
        hf_dir: Callable[..., Path], tmp_path: Path) -> None:
    d = hf_dir("qwen3-0.6b")
    cfg = trainer_job(d, {"dpShard": 2}, 2)
    bad = tmp_path / "gelu"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                 "hidden_act": "gelu"}))
    run = run_trainer(cfg.model_copy(update={"model": cfg.model.model_copy(update={"hf_dir": str(bad)})}),
                      tmp_path / "gelu-run")
    assert run.codes == [EXIT_CONFIG_ERROR] * 2, run.logs()
    assert f"config error: spec.model.hfDir={bad}: {bad}/config.json: hidden_act='gelu'" in run.log(1)

    other = cfg.model_copy(update={"model": cfg.model.model_copy(update={"head_dim": 64})})
    run = run_trainer(other, tmp_path / "dims-run")
    assert run.codes == [EXIT_CONFIG_ERROR] * 2, run.logs()
    assert "head_dim 128 != 64 (spec.model.headDim)" in run.log(0)
