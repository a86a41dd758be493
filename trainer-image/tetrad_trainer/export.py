"""Hugging Face in and out: a committed Tetrad checkpoint as safetensors + config.json that
`transformers.LlamaForCausalLM.from_pretrained` loads, and the same format read back as Tetrad
parameters.

    python -m tetrad_trainer.export CHECKPOINT_DIR OUT_DIR [--step N] [--dtype bfloat16]
    python -m tetrad_trainer.train --init-from HF_DIR ...   (initial weights; see init_from_hf)

Invariants:
- every parameter is mapped by an explicit name table (`hf_name`); a checkpoint or a Hugging Face
  directory with a name outside it, or missing one, is refused with the names;
- Tetrad's attention rotates interleaved pairs (Meta's RoPE: dims 2i, 2i+1), Hugging Face's
  Llama rotates halves (dims i, i + head_dim/2): the rows of wq and wk are permuted per head on
  the way out (`to_half_rope`) and back on the way in (`to_interleaved_rope`), so both models
  compute the same function; `import_hf(export(x)) == x` exactly in fp32;
- the checkpoint is verified against its manifest (size and CRC32 of every file) before it is
  read, and read in one process at whatever layout it was saved with (DCP reshards);
- the Hugging Face config comes from the checkpoint's own resolved ModelConfig (dims, kv heads,
  rope theta, norm eps); Tetrad's embedding and output are untied.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from tetrad.api.resolved import ModelConfig
from tetrad_trainer.checkpoint.store import (
    CheckpointDir,
    CheckpointError,
    read_manifest,
    step_dir_name,
    verify_files,
)
from tetrad_trainer.models.init import canonical_name, local_box
from tetrad_trainer.models.llama import Transformer

WEIGHTS = "model.safetensors"
CONFIG = "config.json"

# Tetrad name (layer-local part) -> Hugging Face Llama name (layer-local part).
_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class ConversionError(ValueError):
    """The checkpoint or the Hugging Face directory cannot be converted; the message says why."""


def hf_name(name: str) -> str:
    """The Hugging Face Llama name of the Tetrad parameter called name."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
    raise ConversionError(f"no Hugging Face name for the Tetrad parameter {name!r}")


def hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The config.json of LlamaForCausalLM for this model."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # transformers 5 reads rope_parameters, 4.x rope_theta (and rope_scaling None: plain RoPE)
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def to_half_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection for rotate-half RoPE, from rows for interleaved RoPE.

    Per head, interleaved row 2i goes to row i and row 2i+1 to row i + head_dim/2.
    """
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def to_interleaved_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of to_half_rope."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _rope_heads(name: str, cfg: ModelConfig) -> int | None:
    """The head count whose rows must be permuted, for wq and wk; None for other parameters."""
    if name.endswith("attention.wq.weight"):
        return cfg.heads
    if name.endswith("attention.wk.weight"):
        return cfg.kv_heads
    return None


def to_hf(params: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Tetrad parameters (full, plain tensors) as the Hugging Face Llama state dict."""
    out = {}
    for name, t in params.items():
        heads = _rope_heads(name, cfg)
        out[hf_name(name)] = (to_half_rope(t, heads) if heads else t).contiguous()
    return out


def _to_tetrad(name: str, t: torch.Tensor, cfg: ModelConfig, shape: tuple[int, ...]) -> torch.Tensor:
    """The Hugging Face tensor of the Tetrad parameter called name, in Tetrad's layout and fp32."""
    if tuple(t.shape) != shape:
        raise ConversionError(f"{hf_name(name)}: shape {tuple(t.shape)}, the model {cfg.name} needs {shape}")
    heads = _rope_heads(name, cfg)
    return (to_interleaved_rope(t, heads) if heads else t).to(torch.float32).contiguous()


def _check_names(have: set[str], cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tetrad name -> shape of every parameter; refuses Hugging Face names that are not exactly the model's."""
    want = expected_shapes(cfg)
    expected = {hf_name(n) for n in want}
    missing, unknown = sorted(expected - have), sorted(have - expected)
    if missing or unknown:
        raise ConversionError(f"the Hugging Face weights do not match the model {cfg.name}: missing {missing[:5]}, "
                              f"unknown {unknown[:5]}")
    return want


def from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama state dict as Tetrad parameters (fp32), checked against cfg's shapes."""
    want = _check_names(set(tensors), cfg)
    return {name: _to_tetrad(name, tensors[hf_name(name)], cfg, shape) for name, shape in want.items()}


def built_in_only(cfg: ModelConfig) -> None:
    """Refuses a model of one's own: the name table is the built-in Llama's."""
    if cfg.module is not None:
        raise ConversionError(f"the model is spec.model.module={cfg.module}: Hugging Face conversion covers the built-in "
                              "Llama only")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the full model and its shape."""
    built_in_only(cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


# -- checkpoints --------------------------------------------------------------------------------

def checkpoint_step_dir(root: str | Path, step: int | None = None) -> Path:
    """The committed checkpoint to export: `step`, or the one `latest` names; verified intact."""
    ckpts = CheckpointDir(root)
    if step is None:
        candidates = ckpts.candidates()
        if not candidates:
            raise ConversionError(f"{root}: no committed checkpoint (no `latest` and no step directory with a manifest)")
        path = candidates[0].path
    else:
        path = ckpts.root / step_dir_name(step)
        if not path.is_dir():
            have = [s for s, _ in ckpts.committed_dirs()]
            raise ConversionError(f"{path}: no such checkpoint; committed steps: {have or 'none'}")
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    if problems := verify_files(path, manifest["files"]):
        raise ConversionError(f"{path} is damaged: {'; '.join(problems)}; export an older step with --step")
    return path


def read_checkpoint(step_dir: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model config and full fp32 parameters of a checkpoint, read in this one process."""
    manifest = read_manifest(step_dir)
    cfg = ModelConfig.model_validate_json(json.dumps(manifest["config"]["model"]))
    params = {n: torch.empty(s, dtype=torch.float32) for n, s in expected_shapes(cfg).items()}
    with warnings.catch_warnings():  # DCP warns that it assumes one process: that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*no_dist.*")
        dcp.load({"model": params}, checkpoint_id=str(step_dir), no_dist=True)
    return cfg, params


def export(checkpoint_dir: str | Path, out_dir: str | Path, *, step: int | None = None,
           dtype: torch.dtype = torch.float32) -> Path:
    """Write OUT_DIR/model.safetensors and OUT_DIR/config.json from a committed checkpoint."""
    step_dir = checkpoint_step_dir(checkpoint_dir, step)
    cfg, params = read_checkpoint(step_dir)
    save_hf(params, cfg, out_dir, dtype=dtype, source=str(step_dir))
    return step_dir


def save_hf(params: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path, *,
            dtype: torch.dtype = torch.float32, source: str = "") -> None:
    """Write full Tetrad parameters as a Hugging Face Llama directory (model.safetensors, config.json)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype) for k, v in to_hf(params, cfg).items()}
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt", "tetrad_source": source})
    (out / CONFIG).write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")


_CONFIG_FIELDS = {"vocab_size": "vocab", "hidden_size": "dim", "intermediate_size": "ffn_dim",
                  "num_hidden_layers": "layers", "num_attention_heads": "heads", "num_key_value_heads": "kv_heads",
                  "rms_norm_eps": "norm_eps", "rope_theta": "rope_theta"}


def _hf_files(hf_dir: str | Path, cfg: ModelConfig) -> dict[str, Path]:
    """Hugging Face name -> the safetensors file holding it, after checking that config.json is cfg's model."""
    from safetensors import safe_open

    built_in_only(cfg)
    hf_dir = Path(hf_dir)
    try:
        hf = json.loads((hf_dir / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ConversionError(f"{hf_dir / CONFIG}: unreadable: {e}") from None
    if hf.get("model_type") != "llama":
        raise ConversionError(f"{hf_dir / CONFIG}: model_type {hf.get('model_type')!r}; only 'llama' is supported")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {"rope_type": "default"}
    if rope.get("rope_type", rope.get("type")) != "default":
        raise ConversionError(f"{hf_dir / CONFIG}: RoPE {rope!r} is not supported by Tetrad's model (plain RoPE only)")
    hf.setdefault("rope_theta", rope.get("rope_theta"))
    differ = [f"{k} {hf.get(k)!r} != {getattr(cfg, f)!r}" for k, f in _CONFIG_FIELDS.items() if hf.get(k) != getattr(cfg, f)]
    if differ:
        raise ConversionError(f"{hf_dir}: not the model {cfg.name}: {', '.join(differ)}")
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"{hf_dir}: no *.safetensors file")
    index: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            index.update(dict.fromkeys(st.keys(), f))
    return index


def import_hf(hf_dir: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Tetrad parameters (full, fp32, by Tetrad name) from a Hugging Face Llama directory
    (config.json and *.safetensors), refused unless its config is the model cfg."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(set(_hf_files(hf_dir, cfg).values())):
        tensors.update(load_file(str(f)))
    return from_hf(tensors, cfg)


@torch.no_grad()
def init_from_hf(parts: list[torch.nn.Module], hf_dir: str | Path, cfg: ModelConfig) -> None:
    """Overwrite the (possibly parallelized) model parts' parameters with Hugging Face weights.

    Each rank copies only its own piece of each parameter; it reads one full parameter at a time
    (memory-mapped), so its peak extra memory is the largest parameter, not the model.
    """
    from safetensors import safe_open

    index = _hf_files(hf_dir, cfg)
    want = _check_names(set(index), cfg)
    for part in parts:
        for fqn, param in part.named_parameters():
            name = canonical_name(fqn)
            with safe_open(str(index[hf_name(name)]), framework="pt") as st:
                full = _to_tetrad(name, st.get_tensor(hf_name(name)), cfg, want[name])
            offset, size = local_box(param)
            local = param.to_local() if isinstance(param, DTensor) else param
            local.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, size, strict=True))])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tetrad_trainer.export",
                                     description="Export a committed Tetrad checkpoint to Hugging Face safetensors.")
    parser.add_argument("checkpoint_dir", help="the job's checkpoint.path (holding `latest` and step-* directories)")
    parser.add_argument("out_dir", help="where model.safetensors and config.json are written")
    parser.add_argument("--step", type=int, default=None, help="the step to export (default: the one `latest` names)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="dtype of the weights")
    args = parser.parse_args(argv)
    try:
        step_dir = export(args.checkpoint_dir, args.out_dir, step=args.step, dtype=getattr(torch, args.dtype))
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"exported {step_dir} to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
