"""Hugging Face export and import (tetrad_trainer.export) against transformers' own Llama.

A tiny Tetrad model takes an AdamW step and is checkpointed by the real Checkpointer (one gloo
process); `python -m tetrad_trainer.export`'s entry point converts it; transformers loads the
result on the CPU and its fp32 logits must equal Tetrad's forward; importing the export gives back
the checkpoint's parameters bit for bit, in process and through the trainer's --init-from.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from tetrad_trainer import export as hf
from tetrad_trainer.checkpoint import Checkpointer, store
from tetrad_trainer.data import BatchLoader, build_source
from tetrad_trainer.model import Transformer, init_weights, initial_value
from torch.distributed.device_mesh import DeviceMesh

from tests.checkpoint.toy import config
from tests.trainer.harness import job, run_trainer
from tetrad.api.contract import EXIT_CONFIG_ERROR

# head_dim 8 (4 RoPE frequencies), grouped-query attention (2 kv heads for 4 query heads)
DIMS = {"dim": 32, "layers": 2, "heads": 4, "kvHeads": 2, "vocab": 96, "ffnDim": 48, "seqLen": 16}
STEP = 1


def _trained(ckpt: Path) -> tuple[Transformer, dict[str, torch.Tensor]]:
    """A model after one AdamW step, its parameters perturbed (so no norm weight is all ones),
    saved to ckpt by the trainer's Checkpointer."""
    cfg = config({}, ckpt, dims=DIMS)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    init_weights(model, torch.device("cpu"), seed=7)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, cfg.model.vocab, (2, cfg.model.seq_len + 1), generator=g)
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()
    ckpt_er = Checkpointer(cfg, model_parts=[model], optimizers=[opt])
    ckpt_er.save(STEP, blocking=True)
    ckpt_er.close()
    return model, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_export_loads_in_transformers_with_the_same_logits_and_imports_back(one_rank_mesh: DeviceMesh,
                                                                            tmp_path: Path) -> None:
    model, params = _trained(tmp_path / "ckpt")
    out = tmp_path / "hf"
    assert hf.main([str(tmp_path / "ckpt"), str(out), "--step", str(STEP)]) == 0

    config_json = json.loads((out / "config.json").read_text())
    assert config_json["num_key_value_heads"] == 2 and config_json["tie_word_embeddings"] is False
    hf_model = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    assert hf_model.config.rope_parameters["rope_theta"] == model.cfg.rope_theta
    assert hf_model.config.rms_norm_eps == model.cfg.norm_eps

    tokens = torch.randint(0, model.cfg.vocab, (3, model.cfg.seq_len),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens)
        got = hf_model(tokens).logits
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)

    # Without the q/k row permutation the two models would disagree: the test can tell.
    assert not torch.equal(hf.to_half_rope(params["layers.0.attention.wq.weight"], 4),
                           params["layers.0.attention.wq.weight"])

    back = hf.import_hf(out, model.cfg)
    assert back.keys() == params.keys()
    for name, want_p in params.items():
        assert torch.equal(back[name], want_p), f"{name} changed in the round trip"


def test_the_latest_checkpoint_is_exported_and_a_damaged_one_is_refused(one_rank_mesh: DeviceMesh,
                                                                        tmp_path: Path) -> None:
    _, params = _trained(tmp_path / "ckpt")
    assert hf.export(tmp_path / "ckpt", tmp_path / "hf").name == f"step-{STEP:08d}"

    with pytest.raises(hf.ConversionError, match="no such checkpoint; committed steps: \\[1\\]"):
        hf.export(tmp_path / "ckpt", tmp_path / "x", step=5)
    shard = next((tmp_path / "ckpt" / f"step-{STEP:08d}").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(hf.ConversionError, match=r"is damaged: refusing .*step-00000001: __0_0.distcp: CRC32 "
                                                 r".* \(corrupted\)"):
        hf.export(tmp_path / "ckpt", tmp_path / "x")


def test_export_checks_out_dir_first_and_falls_back_as_resume_does(one_rank_mesh: DeviceMesh, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt"
    _trained(ckpt)
    (ckpt / "latest").write_text("step-00000009\n")  # names a step that is not there: resume falls back
    assert hf.main([str(ckpt), str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err
    assert f"refusing {ckpt}/step-00000009: {ckpt}/step-00000009/MANIFEST.json: missing" in err, err
    assert f"falling back to the previous good checkpoint {ckpt}/step-{STEP:08d}" in err, err

    def unread(*_: object) -> None:
        raise AssertionError("the checkpoint was read before OUT_DIR was checked")

    monkeypatch.setattr(hf, "read_checkpoint", unread)
    (tmp_path / "file").write_text("x")
    assert hf.main([str(ckpt), str(tmp_path / "file")]) == 1
    assert capsys.readouterr().err == (f"error: OUT_DIR {tmp_path}/file is a file, not a directory; move "
                                       "that file away or give a directory\n")

    def read_only(path: Path, data: bytes) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(store, "write_file", read_only)
    assert hf.main([str(ckpt), str(tmp_path / "ro")]) == 1
    err = capsys.readouterr().err
    assert (err.startswith(f"error: OUT_DIR {tmp_path}/ro is not writable by uid ")
            and err.count("\n") == 1), err
    assert err.endswith("(Read-only file system); give a directory you can write\n"), err
    monkeypatch.undo()

    assert hf.main([str(tmp_path / "nowhere"), str(tmp_path / "hf2")]) == 1
    assert capsys.readouterr().err == (f"error: CHECKPOINT_DIR {tmp_path}/nowhere: no such directory; give "
                                       "the job's checkpoint.path\n")


def test_import_refuses_weights_of_another_model(one_rank_mesh: DeviceMesh, tmp_path: Path) -> None:
    model, _ = _trained(tmp_path / "ckpt")
    hf.export(tmp_path / "ckpt", tmp_path / "hf")
    other = model.cfg.model_copy(update={"kv_heads": 4})
    with pytest.raises(hf.ConversionError, match="num_key_value_heads 2 != 4"):
        hf.import_hf(tmp_path / "hf", other)


def test_init_from_hf_fills_a_model_with_the_exported_weights(one_rank_mesh: DeviceMesh,
                                                              tmp_path: Path) -> None:
    model, params = _trained(tmp_path / "ckpt")
    hf.export(tmp_path / "ckpt", tmp_path / "hf")
    with torch.device("meta"):
        fresh = Transformer(model.cfg)
    init_weights(fresh, torch.device("cpu"), seed=8)
    hf.init_from_hf([fresh], tmp_path / "hf", model.cfg)
    for name, p in fresh.named_parameters():
        assert torch.equal(p, params[name]), name


@pytest.mark.distributed
@pytest.mark.slow
def test_the_trainer_starts_from_hugging_face_weights_under_tensor_parallelism(tmp_path: Path) -> None:
    """`--init-from` on 2 tensor-parallel ranks: each copies its own rows/columns (wq and wk
    permuted back). lr 1e-30 leaves every weight unchanged by the one step, so the gathered
    parameters after training are the Hugging Face ones exactly."""
    cfg = job({"tp": 2}, nproc=2, model={"seqLen": 32},
              training={"steps": 1, "globalBatch": 2, "precision": "fp32", "lr": 1e-30, "minLr": 0.0,
                        "warmupSteps": 0, "seed": 3})
    with torch.device("meta"):
        source = Transformer(cfg.model)
    init_weights(source, torch.device("cpu"), seed=11)
    weights = {n: p.detach() for n, p in source.named_parameters()}
    hf.save_hf(weights, cfg.model, tmp_path / "hf")

    run = run_trainer(cfg, tmp_path / "run",
                      args=("--init-from", str(tmp_path / "hf"), "--save-full-parameters",
                            str(tmp_path / "p.pt")))
    assert run.codes == [0, 0], run.logs()
    assert f"initial weights from the Hugging Face model {tmp_path / 'hf'}" in run.log(0)
    got = torch.load(tmp_path / "p.pt")
    assert got.keys() == weights.keys()
    for name, want in weights.items():
        assert torch.equal(got[name], want), f"{name} is not the Hugging Face weight"
    seed3 = initial_value("tok_embeddings.weight", weights["tok_embeddings.weight"].shape, cfg.model, 3)
    assert not torch.equal(got["tok_embeddings.weight"], seed3)


def test_the_trainer_refuses_weights_of_another_model_with_exit_78(tmp_path: Path) -> None:
    cfg = job({}, nproc=1, training={"steps": 1, "globalBatch": 1, "precision": "fp32"})
    other = cfg.model.model_copy(update={"layers": cfg.model.layers + 1})
    with torch.device("meta"):
        source = Transformer(other)
    init_weights(source, torch.device("cpu"), seed=1)
    hf.save_hf({n: p.detach() for n, p in source.named_parameters()}, other, tmp_path / "hf")
    run = run_trainer(cfg, tmp_path / "run", args=("--init-from", str(tmp_path / "hf")))
    assert run.codes == [EXIT_CONFIG_ERROR], run.logs()
    assert f"num_hidden_layers {other.layers} != {cfg.model.layers}" in run.log(0)


def test_a_truncated_init_from_file_exits_78_naming_the_field_and_the_file(tmp_path: Path) -> None:
    hf_dir = tmp_path / "hf"
    cfg = job({}, nproc=1, training={"steps": 1, "globalBatch": 1, "precision": "fp32",
                                     "initFrom": str(hf_dir)})
    with torch.device("meta"):
        source = Transformer(cfg.model)
    init_weights(source, torch.device("cpu"), seed=1)
    hf.save_hf({n: p.detach() for n, p in source.named_parameters()}, cfg.model, hf_dir)
    weights = hf_dir / hf.WEIGHTS
    with open(weights, "r+b") as f:  # a copy cut short
        f.truncate(weights.stat().st_size // 2)
    run = run_trainer(cfg, tmp_path / "run")
    assert run.codes == [EXIT_CONFIG_ERROR], run.logs()
    lines = [ln for ln in run.log(0).splitlines() if "config error" in ln]
    assert lines == [f"[tetrad rank 0] config error: spec.training.initFrom={hf_dir}: {weights}: not a whole "
                     "safetensors file (Error while deserializing header: incomplete metadata, file not "
                     "fully covered); copy it again"], run.log(0)
    assert "Traceback" not in run.log(0)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_checkpoint_of_sharded_ranks_exports_whole(tmp_path: Path) -> None:
    """The real trainer on tp=2 x dpShard=2 checkpoints its shards; the export (one process)
    holds the full parameters it trained, bit for bit."""
    cfg = job({"tp": 2, "dpShard": 2}, nproc=4, model={"seqLen": 32},
              training={"steps": 2, "globalBatch": 4, "precision": "fp32", "seed": 5},
              checkpoint={"enabled": True, "path": str(tmp_path / "ckpt"), "interval": 100})
    run = run_trainer(cfg, tmp_path / "run", args=("--save-full-parameters", str(tmp_path / "p.pt")))
    assert run.codes == [0] * 4, run.logs()
    assert hf.main([str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    trained = torch.load(tmp_path / "p.pt")
    back = hf.import_hf(tmp_path / "hf", cfg.model)
    assert back.keys() == trained.keys()
    for name, want in trained.items():
        assert torch.equal(back[name], want), name


@pytest.mark.distributed
@pytest.mark.slow
def test_a_job_started_from_an_exported_checkpoint_has_the_exporting_models_loss(tmp_path: Path) -> None:
    """Job A trains 2 steps (dpShard=2) and checkpoints; its export is job B's spec.training.initFrom
    (through the resolved config, no flag). B's first loss is the loss of A's final weights on B's
    first batch, computed here in one process; it is not the loss of the seed's weights."""
    training = {"globalBatch": 4, "precision": "fp32", "lr": 1e-2, "warmupSteps": 0, "seed": 5}
    a = job({"dpShard": 2}, nproc=2, model={"seqLen": 32}, training={**training, "steps": 2},
            checkpoint={"enabled": True, "path": str(tmp_path / "ckpt"), "interval": 100})
    run_a = run_trainer(a, tmp_path / "a", args=("--save-full-parameters", str(tmp_path / "a.pt")))
    assert run_a.codes == [0, 0], run_a.logs()
    assert hf.main([str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0

    b = job({"dpShard": 2}, nproc=2, model={"seqLen": 32},
            training={**training, "steps": 1, "initFrom": str(tmp_path / "hf")})
    assert b.training.init_from == str(tmp_path / "hf")
    run_b = run_trainer(b, tmp_path / "b")
    assert run_b.codes == [0, 0], run_b.logs()
    assert f"initial weights from the Hugging Face model {tmp_path / 'hf'}" in run_b.log(0)
    (first,) = [r["loss"] for r in run_b.records if "step" in r]

    with torch.device("meta"):
        model = Transformer(b.model)
    init_weights(model, torch.device("cpu"), seed=b.training.seed)
    seeded = {n: p.detach().clone() for n, p in model.named_parameters()}
    inputs, labels = BatchLoader(build_source(b), b.training.global_batch, dp_rank=0, dp_size=1).next_batch()

    def loss_with(params: dict[str, torch.Tensor]) -> float:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n])
            return F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).item()

    exporting = loss_with(torch.load(tmp_path / "a.pt"))
    assert first == pytest.approx(exporting, rel=1e-5)
    assert abs(loss_with(seeded) - exporting) > 1e-3 * exporting, "A's two steps must have moved the loss"
