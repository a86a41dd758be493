"""The families' config.json, read and written (tetrad.api.families), the presets of published checkpoints,
and the CLI taking a model from a Hugging Face directory it can read. No torch: config files only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.api.helpers import manifest
from tests.api.test_cli import tetrad, write
from tests.hf_configs import PRESET_OF, PUBLISHED
from tetrad.api.families import HF_FIELDS, hf_differences, model_fields, read_hf_config, write_hf_config
from tetrad.api.presets import PRESETS
from tetrad.resolve import validate_document

ONE_PROCESS = {"nodes": 1, "nprocPerNode": 1, "parallelism": {"pp": 1, "tp": 1, "dpShard": 1}}


def model_of(config: dict[str, Any], seq_len: int = 256) -> Any:
    """The resolved ModelConfig of a job whose spec.model is config.json's fields."""
    from tests.trainer.harness import job

    fields = read_hf_config(config).fields
    return job({}, nproc=1, model={**fields, "seqLen": seq_len}).model


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_a_published_config_reads_as_its_preset(name: str) -> None:
    """Every published checkpoint loads (Llama 3.1/3.2 scaling, tying, no rope_theta in Llama 2, Qwen's inert
    sliding_window), and its preset has exactly its family and dims."""
    hf = read_hf_config(PUBLISHED[name])
    assert hf.problems == []
    preset = PRESETS[PRESET_OF[name]]
    assert {f: preset[f] for f in HF_FIELDS} == hf.fields  # type: ignore[literal-required]
    assert hf.max_positions == PUBLISHED[name]["max_position_embeddings"]


def test_transformers_defaults_fill_absent_keys() -> None:
    llama2 = read_hf_config(PUBLISHED["llama2-7b"]).fields
    assert llama2["ropeTheta"] == 10000.0 and llama2["ropeScaling"] is None
    bare = read_hf_config({"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4}).fields
    # Qwen3Config's defaults
    assert bare["headDim"] == 128 and bare["kvHeads"] == 32 and bare["normEps"] == 1e-6
    bare = read_hf_config({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}).fields
    assert bare["headDim"] == 16 and bare["kvHeads"] == 4 and bare["vocab"] == 32000
    assert read_hf_config({"model_type": "qwen2",
                           "rope_parameters": {"rope_type": "default", "rope_theta": 3.0}}
                           ).fields["ropeTheta"] == 3.0  # transformers 5's key


REFUSED = [
    ("llama3.1-8b", {"hidden_act": "gelu"}, "hidden_act='gelu': Tetrad's block is SwiGLU with silu"),
    ("llama3.1-8b", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
    ("llama2-7b", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic'"),
    ("llama2-7b", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type='linear'"),
    ("qwen3-8b",
     {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     "rope_scaling.rope_type='yarn'"),
    ("llama3.1-8b", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope_type llama3 needs low_freq_factor"),
    ("llama3.1-8b", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("llama3.1-8b", {"attention_bias": True}, "attention_bias=True: biases on q, k, v and o"),
    ("llama3.1-8b", {"mlp_bias": True}, "mlp_bias=True"),
    ("llama3.1-8b", {"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ("llama3.1-8b", {"quantization_config": {"quant_method": "awq"}}, "quantization_config="),
    ("qwen3-8b", {"attention_bias": True}, "attention_bias=True"),
    ("qwen2.5-7b", {"use_sliding_window": True}, "use_sliding_window=True: sliding-window attention"),
    ("qwen2.5-7b", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types="),
    ("mistral-7b", {"sliding_window": 4096}, "sliding_window=4096: sliding-window attention"),
    # Mistral v0.1's file had a window; transformers' Mistral defaults to one when the key is absent
    ("mistral-7b", {"sliding_window": "absent"}, "sliding_window=4096"),
    ("llama3.1-8b", {"model_type": "gemma"}, "model_type='gemma': not a family Tetrad's decoder implements"),
    ("llama3.1-8b", {"num_hidden_layers": "32"}, "num_hidden_layers='32': not a positive integer"),
]


@pytest.mark.parametrize("base, change, message", REFUSED, ids=[m.split(":")[0] for _, _, m in REFUSED])
def test_what_changes_the_forward_pass_and_is_not_implemented_is_refused_by_name(base: str,
                                                                                 change: dict[str, Any],
                                                                                 message: str) -> None:
    config = {k: v for k, v in {**PUBLISHED[base], **change}.items() if v != "absent"}
    problems = read_hf_config(config).problems
    assert any(message in p for p in problems), problems


def test_the_written_config_reads_back_as_the_model_and_keeps_the_source() -> None:
    for name, source in PUBLISHED.items():
        cfg = model_of(source)
        written = write_hf_config(cfg, dtype="bfloat16", source=source)
        back = read_hf_config(written)
        assert back.problems == [] and hf_differences(back.fields, cfg) == [], name
        for key in ("bos_token_id", "eos_token_id", "max_position_embeddings", "transformers_version"):
            assert written[key] == source[key], (name, key)
        assert written["torch_dtype"] == "bfloat16"
        # from scratch (no source): the training length is the context, and it still reads back
        alone = write_hf_config(cfg, dtype="float32")
        assert alone["max_position_embeddings"] == cfg.seq_len and "bos_token_id" not in alone
        assert hf_differences(read_hf_config(alone).fields, cfg) == [], name


def test_a_difference_names_the_key_and_the_field() -> None:
    cfg = model_of(PUBLISHED["qwen3-0.6b"])
    fields = dict(model_fields(cfg), layers=3, headDim=64, tieEmbeddings=False)
    assert hf_differences(fields, cfg) == ["num_hidden_layers 3 != 28 (spec.model.layers)",
                                           "head_dim 64 != 128 (spec.model.headDim)",
                                           "tie_word_embeddings False != True (spec.model.tieEmbeddings)"]


def test_the_cluster_needs_a_preset_or_the_dims_and_the_trainer_gets_the_directory() -> None:
    job = {**ONE_PROCESS, "model": {"hfDir": "/models/qwen3"}}
    problems = [p for p in validate_document(manifest(**job)) if p.severity == "error"]
    assert [p.field for p in problems] == ["spec.model.hfDir"] and "tetrad model DIR" in problems[0].message
    from tests.trainer.harness import job as resolved

    cfg = resolved({}, nproc=1, model={"preset": "qwen3-0.6b", "hfDir": "/models/qwen3", "seqLen": 64})
    assert cfg.model.hf_dir == "/models/qwen3" and cfg.model.qk_norm and cfg.model.head_dim == 128
    cfg = resolved({}, nproc=1, training={"initFrom": "/models/llama"})  # the former way: the same field
    assert cfg.model.hf_dir == "/models/llama"
    both = manifest(**ONE_PROCESS, model={"preset": "debug", "hfDir": "/a"},
                    training={"initFrom": "/b", "globalBatch": 8})
    assert [p.field for p in validate_document(both) if p.severity == "error"] == ["spec.training.initFrom"]


def hf_dir(tmp_path: Path, config: dict[str, Any]) -> Path:
    d = tmp_path / "hf"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_the_cli_takes_the_model_from_a_directory_it_can_read(tmp_path: Path) -> None:
    d = hf_dir(tmp_path, PUBLISHED["qwen3-0.6b"])
    doc = manifest(nodes=1, nprocPerNode=2, parallelism={"pp": 1, "tp": 2, "dpShard": 1},
                   model={"hfDir": str(d), "seqLen": 2048}, resources={"gpu": 2, "gpuMemoryGiB": 80})
    path = write(tmp_path, "job.yaml", doc)
    r = tetrad("validate", path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    r = tetrad("plan", "--json", path)
    assert r.returncode == 0, r.stdout + r.stderr
    model = json.loads(r.stdout)["model"]
    assert (model["family"], model["headDim"], model["dim"], model["tieEmbeddings"], model["qkNorm"]) == \
        ("qwen3", 128, 1024, True, True)
    assert model["params"] == 596049920  # Qwen3-0.6B: 0.6B parameters, the tied embedding once

    # what the manifest says that the directory contradicts is named; so is a preset of another model
    for model_spec, field in (({"hfDir": str(d), "heads": 8}, "spec.model.heads"),
                              ({"hfDir": str(d), "preset": "qwen3-1.7b"}, "spec.model.preset")):
        r = tetrad("validate",
                   write(tmp_path, "bad.yaml", {**doc, "spec": {**doc["spec"], "model": model_spec}}))
        assert r.returncode == 1 and f"{field}: " in r.stderr and "config.json says" in r.stderr, r.stderr
    # seqLen beyond the checkpoint's context is a warning
    r = tetrad("validate", write(tmp_path, "long.yaml", {
        **doc, "spec": {**doc["spec"], "model": {"hfDir": str(d), "seqLen": 65536}}}))
    assert r.returncode == 0 and "warning" in r.stderr and "max_position_embeddings=40960" in r.stderr
    # a config Tetrad does not implement: named, and plan refuses it too
    hf_dir(tmp_path, {**PUBLISHED["qwen3-0.6b"], "hidden_act": "gelu"})
    for command in (("validate", path), ("plan", path)):
        r = tetrad(*command)
        assert (r.returncode == 1 and "spec.model.hfDir: " in r.stderr
                and "hidden_act='gelu'" in r.stderr), r.stderr


def test_tetrad_model_prints_the_spec_model_for_a_directory(tmp_path: Path) -> None:
    r = tetrad("model", str(hf_dir(tmp_path, PUBLISHED["llama3.2-1b"])))
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["model"]["preset"] == "llama3.2-1b"
    custom = {**PUBLISHED["llama3.2-1b"], "num_hidden_layers": 4}
    model = yaml.safe_load(tetrad("model", str(hf_dir(tmp_path, custom))).stdout)["model"]
    assert model["layers"] == 4 and model["family"] == "llama" and model["tieEmbeddings"] is True
    assert model["ropeScaling"]["factor"] == 32.0 and model["seqLen"] == 4096
    # what it prints is a valid spec.model
    job = manifest(**ONE_PROCESS, model={**model, "hfDir": "/models/x"})
    assert [p for p in validate_document(job) if p.severity == "error"] == []
    r = tetrad("model",
               str(hf_dir(tmp_path, {**custom, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})))
    assert r.returncode == 1 and "rope_scaling.rope_type='yarn'" in r.stderr
    r = tetrad("model", str(tmp_path / "nowhere"))
    assert r.returncode == 1 and "cannot read" in r.stderr and "Traceback" not in r.stderr
