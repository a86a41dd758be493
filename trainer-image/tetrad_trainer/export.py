"""Hugging Face in and out: a committed Tetrad checkpoint as the Hugging Face directory of its family
(LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM), and such a directory
read back as Tetrad parameters.

    python -m tetrad_trainer.export CHECKPOINT_DIR OUT_DIR [--step N] [--dtype bfloat16] [--source HF_DIR]
    spec.model.hfDir (or training.initFrom, --init-from HF_DIR): initial weights; see init_from_hf

Invariants:
- every parameter is mapped by an explicit name table (`hf_name`); a checkpoint or a Hugging Face
  directory with a name outside it, or missing one, is refused with the names;
- Tetrad's attention rotates interleaved pairs (Meta's RoPE: dims 2i, 2i+1), Hugging Face's
  families rotate halves (dims i, i + head_dim/2): the rows of wq and wk, their biases and the
  q/k norms' weights are permuted per head on the way out (`to_half_rope`) and back on the way in
  (`to_interleaved_rope`), so both models compute the same function; `import_hf(export(x)) == x`
  exactly in fp32, and a directory imported and exported again holds the same tensors;
- a tied output projection is the embedding: written once (no lm_head.weight), as transformers does;
- config.json is the family's (tetrad.api.families.write_hf_config), written over the source's
  config.json when the model came from a Hugging Face directory, whose token ids,
  max_position_embeddings and other keys are kept, with its generation_config.json and tokenizer
  files copied along. The trainer keeps those files in the checkpoint directory (`keep_source`);
  the default dtype is the source's;
- weights above `max_shard_bytes` (transformers' default, 50 GB) are split into
  model-0000i-of-0000n.safetensors with model.safetensors.index.json;
- OUT_DIR is checked first (a directory this process can write); the checkpoint exported is the
  one resume would load (store.first_intact: `latest`, else the next older intact one), or --step,
  verified against its manifest (size and CRC32 of every file) before it is read, and read in one
  process at whatever layout it was saved with (DCP reshards).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from tetrad.api.families import hf_differences, read_hf_config, write_hf_config
from tetrad.api.resolved import ModelConfig
from tetrad_trainer.checkpoint.store import (
    Candidate,
    CheckpointDir,
    first_intact,
    read_manifest,
    step_dir_name,
    unwritable,
    verified_here,
)
from tetrad_trainer.models.init import canonical_name, local_box
from tetrad_trainer.models.llama import Transformer

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
# in a checkpoint directory: the source's config.json, generation config and tokenizer
SOURCE_DIR = "hf-source"
MAX_SHARD_BYTES = 50 * 10**9  # transformers' save_pretrained default, "50GB"
# The files of a Hugging Face directory beside its config and weights that the export carries along.
SOURCE_FILES = ("generation_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
                "merges.txt", "chat_template.json")
SOURCE_PATTERNS = ("tokenizer*", "*.jinja", "*.tiktoken")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Tetrad name (layer-local part) -> Hugging Face name (layer-local part), the same for every family.
_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
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
# Layer-local names whose rows (or channels) are per-head RoPE pairs: query heads, kv heads, or one
# head_dim vector.
_ROPE_ROWS = {"attention.wq.weight": "heads", "attention.wq.bias": "heads", "attention.wk.weight": "kv_heads",
              "attention.wk.bias": "kv_heads", "attention.q_norm.weight": "one",
              "attention.k_norm.weight": "one"}


class ConversionError(ValueError):
    """The checkpoint or the Hugging Face directory cannot be converted; the message says why."""


def hf_name(name: str) -> str:
    """The Hugging Face name of the Tetrad parameter called name."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
    raise ConversionError(f"no Hugging Face name for the Tetrad parameter {name!r}")


def hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32,
              source: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json of cfg's family for this model (over the source's config.json when given)."""
    try:
        return write_hf_config(cfg, dtype=str(dtype).removeprefix("torch."), source=source)
    except ValueError as e:
        raise ConversionError(str(e)) from None


def to_half_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection (or entries of its bias, of a q/k norm) for rotate-half RoPE, from rows for
    interleaved RoPE. Per head, interleaved row 2i goes to row i and row 2i+1 to row i + head_dim/2."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def to_interleaved_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of to_half_rope."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, -1).transpose(1, 2).reshape(w.shape)


def _rope_heads(name: str, cfg: ModelConfig) -> int | None:
    """The head count whose rows must be permuted (wq, wk, their biases, the q/k norms); None for other
    parameters."""
    which = _ROPE_ROWS.get(name.split(".", 2)[-1]) if name.startswith("layers.") else None
    return {"heads": cfg.heads, "kv_heads": cfg.kv_heads, "one": 1, None: None}[which]


def to_hf(params: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Tetrad parameters (full, plain tensors) as the Hugging Face state dict (a tied output left out)."""
    out = {}
    for name, t in params.items():
        if name in _tied_away(cfg):
            continue
        heads = _rope_heads(name, cfg)
        out[hf_name(name)] = (to_half_rope(t, heads) if heads else t).contiguous()
    return out


def _tied_away(cfg: ModelConfig) -> tuple[str, ...]:
    """Tetrad names that are another parameter: the tied output projection is the embedding."""
    return ("output.weight",) if cfg.tie_embeddings else ()


def _source_name(name: str, cfg: ModelConfig) -> str:
    return "tok_embeddings.weight" if name in _tied_away(cfg) else name


def _to_tetrad(name: str, t: torch.Tensor, cfg: ModelConfig, shape: tuple[int, ...]) -> torch.Tensor:
    """The Hugging Face tensor of the Tetrad parameter called name, in Tetrad's layout and fp32."""
    if tuple(t.shape) != shape:
        raise ConversionError(f"{hf_name(name)}: shape {tuple(t.shape)}, the model {cfg.name} needs {shape}")
    heads = _rope_heads(name, cfg)
    return (to_interleaved_rope(t, heads) if heads else t).to(torch.float32).contiguous()


def _check_names(have: set[str], cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tetrad name -> shape of every parameter; refuses Hugging Face names that are not exactly the model's
    (a tied model's directory may repeat the embedding as lm_head.weight; import_hf checks it is the same)."""
    want = expected_shapes(cfg)
    expected = {hf_name(n) for n in want}
    missing = sorted(expected - have)
    unknown = sorted(have - expected - ({hf_name("output.weight")} if cfg.tie_embeddings else set()))
    if missing or unknown:
        tied = " (tie_word_embeddings is false: the output projection lm_head.weight is its own tensor)" \
            if hf_name("output.weight") in missing else ""
        raise ConversionError(f"the Hugging Face weights do not match the model {cfg.name}: "
                              f"missing {missing[:5]}, unknown {unknown[:5]}{tied}")
    return want


def from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict as Tetrad parameters (fp32), checked against cfg's shapes."""
    want = _check_names(set(tensors), cfg)
    lm_head, embed = hf_name("output.weight"), hf_name("tok_embeddings.weight")
    if cfg.tie_embeddings and lm_head in tensors and not torch.equal(tensors[lm_head], tensors[embed]):
        raise ConversionError(f"{lm_head} differs from {embed}, but tie_word_embeddings is true: "
                              "the directory is not one tied model")
    return {name: _to_tetrad(name, tensors[hf_name(name)], cfg, shape) for name, shape in want.items()}


def built_in_only(cfg: ModelConfig) -> None:
    """Refuses a model of one's own: the name table is the built-in decoder's."""
    if cfg.module is not None or cfg.family is None:
        raise ConversionError(f"the model is spec.model.module={cfg.module}: Hugging Face conversion covers "
                              "the built-in families only")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the full model and its shape (a tied pair once, as the embedding)."""
    built_in_only(cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


# -- checkpoints --------------------------------------------------------------------------------

def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def checkpoint_step_dir(root: str | Path, step: int | None = None,
                        say: Callable[[str], None] = _stderr) -> Path:
    """The committed checkpoint to export, verified intact: `step`, or the one resume would load (the one
    `latest` names, else the next older intact one; `say` gets the refusals)."""
    ckpts = CheckpointDir(root)
    if not ckpts.root.is_dir():
        what = "is a file, not a checkpoint directory" if ckpts.root.exists() else "no such directory"
        raise ConversionError(f"CHECKPOINT_DIR {root}: {what}; give the job's checkpoint.path")
    if step is None:
        cand, _, refused = first_intact(ckpts.candidates(), verified_here, say)
        if cand is not None:
            return cand.path
        if refused:
            raise ConversionError(f"every checkpoint in {root} is damaged: {' | '.join(refused)}")
        raise ConversionError(f"{root}: no committed checkpoint "
                              "(no `latest` and no step directory with a manifest)")
    path = ckpts.root / step_dir_name(step)
    if not path.is_dir():
        have = [s for s, _ in ckpts.committed_dirs()]
        raise ConversionError(f"{path}: no such checkpoint; committed steps: {have or 'none'}")
    _, problems = verified_here(Candidate(path, step))
    if problems:
        raise ConversionError(f"{path} is damaged: {'; '.join(problems)}; export an older step with --step")
    return path


def check_out_dir(out_dir: str | Path) -> None:
    """OUT_DIR must be a directory this process can write (created if missing): checked before the
    checkpoint is read."""
    if (found := unwritable(out_dir)) is not None:
        why, file = found
        fix = "move that file away or give a directory" if file else "give a directory you can write"
        raise ConversionError(f"OUT_DIR {why}; {fix}")


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


def source_of(checkpoint_dir: str | Path, cfg: ModelConfig, source: str | Path | None = None) -> Path | None:
    """The Hugging Face directory a checkpoint's model came from, for its config.json and tokenizer: `source`,
    else the copy the trainer kept in the checkpoint directory, else cfg.hf_dir where it is readable here."""
    for candidate in (source, Path(checkpoint_dir) / SOURCE_DIR, cfg.hf_dir):
        if candidate is not None and (Path(candidate) / CONFIG).is_file():
            return Path(candidate)
    if source is not None:
        raise ConversionError(f"--source {source}: no {CONFIG} there")
    return None


def export(checkpoint_dir: str | Path, out_dir: str | Path, *, step: int | None = None,
           dtype: torch.dtype | None = None, source: str | Path | None = None,
           max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write OUT_DIR as a Hugging Face directory from a committed checkpoint; returns the step directory
    read."""
    check_out_dir(out_dir)
    step_dir = checkpoint_step_dir(checkpoint_dir, step)
    cfg, params = read_checkpoint(step_dir)
    save_hf(params, cfg, out_dir, dtype=dtype, source=source_of(checkpoint_dir, cfg, source),
            origin=str(step_dir), max_shard_bytes=max_shard_bytes)
    return step_dir


def _source_config(source: Path | None) -> dict[str, Any] | None:
    if source is None:
        return None
    try:
        config = json.loads((source / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ConversionError(f"{source / CONFIG}: unreadable: {e}") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{source / CONFIG}: not a JSON object")
    return config


def _source_dtype(config: dict[str, Any] | None) -> torch.dtype:
    name = (config or {}).get("torch_dtype") or (config or {}).get("dtype") or "float32"
    return DTYPES.get(name, torch.float32) if isinstance(name, str) else torch.float32


def source_files(source: Path) -> Iterator[Path]:
    """The generation config and tokenizer files of a Hugging Face directory (its top level)."""
    for f in sorted(source.iterdir()):
        if f.is_file() and (f.name in SOURCE_FILES or any(f.match(p) for p in SOURCE_PATTERNS)):
            yield f


def save_hf(params: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path, *,
            dtype: torch.dtype | None = None, source: Path | None = None, origin: str = "",
            max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write full Tetrad parameters as a Hugging Face directory: config.json, the weights (one file, or shards
    with an index above max_shard_bytes), and the source's generation config and tokenizer files."""
    from safetensors.torch import save_file

    source_config = _source_config(source)
    dtype = dtype or _source_dtype(source_config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in to_hf(params, cfg).items()}
    shards = _shards(tensors, max_shard_bytes)
    names = [WEIGHTS] if len(shards) == 1 else [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                                 for i in range(1, len(shards) + 1)]
    for stale in [*out.glob("model*.safetensors"), out / INDEX]:  # an earlier export's other sharding
        if stale.name not in names:
            stale.unlink(missing_ok=True)
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(out / name), metadata={"format": "pt", "tetrad_source": origin})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: name for name, shard in zip(names, shards, strict=True) for k in shard}}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    if source is not None and source.resolve() != out.resolve():
        for f in source_files(source):
            shutil.copyfile(f, out / f.name)
    config = hf_config(cfg, dtype, source_config)
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most max_bytes each (a larger tensor alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def keep_source(hf_dir: str | Path, checkpoint_dir: str | Path) -> None:
    """Copy a Hugging Face directory's config.json, generation config and tokenizer files to
    CHECKPOINT_DIR/hf-source (replacing an earlier copy at once), so the export finds them beside the
    checkpoints wherever it runs."""
    hf_dir, root = Path(hf_dir), Path(checkpoint_dir)
    tmp = root / f".tmp-{SOURCE_DIR}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in [hf_dir / CONFIG, *source_files(hf_dir)]:
        shutil.copyfile(f, tmp / f.name)
    old = root / f".trash-{SOURCE_DIR}.{os.getpid()}"
    if (root / SOURCE_DIR).exists():
        os.rename(root / SOURCE_DIR, old)
    os.rename(tmp, root / SOURCE_DIR)
    shutil.rmtree(old, ignore_errors=True)


# -- Hugging Face directories --------------------------------------------------------------------

def read_config(hf_dir: str | Path) -> dict[str, Any]:
    """HF_DIR/config.json as a dict."""
    path = Path(hf_dir) / CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConversionError(f"{path}: unreadable: {e}") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: not a JSON object")
    return config


def check_hf_dir(hf_dir: str | Path, cfg: ModelConfig) -> None:
    """Refuse a directory whose config.json Tetrad does not implement (naming each key and its value) or
    that contradicts the model cfg (naming the config.json key and the spec.model field)."""
    built_in_only(cfg)
    hf = read_hf_config(read_config(hf_dir))
    where = Path(hf_dir) / CONFIG
    if hf.problems:
        raise ConversionError(f"{where}: {'; '.join(hf.problems)}")
    if differ := hf_differences(hf.fields, cfg):
        raise ConversionError(f"{where}: not the model {cfg.name}: {', '.join(differ)}")


def _hf_files(hf_dir: str | Path, cfg: ModelConfig) -> dict[str, Path]:
    """Hugging Face name -> the safetensors file holding it, after checking that config.json is cfg's model
    and that every file's header reads and covers the file."""
    from safetensors import SafetensorError, safe_open

    check_hf_dir(hf_dir, cfg)
    hf_dir = Path(hf_dir)
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"{hf_dir}: no *.safetensors file")
    index: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                index.update(dict.fromkeys(st.keys(), f))
        except (OSError, SafetensorError) as e:  # a truncated file: its header does not cover it
            raise ConversionError(f"{f}: not a whole safetensors file ({e}); copy it again") from None
    return index


def import_hf(hf_dir: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Tetrad parameters (full, fp32, by Tetrad name) from a Hugging Face directory (config.json and
    *.safetensors), refused unless its config is the model cfg."""
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
            # a pipeline's last stage holds the tied copy as output
            name = _source_name(canonical_name(fqn), cfg)
            with safe_open(str(index[hf_name(name)]), framework="pt") as st:
                full = _to_tetrad(name, st.get_tensor(hf_name(name)), cfg, want[name])
            offset, size = local_box(param)
            local = param.to_local() if isinstance(param, DTensor) else param
            local.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, size, strict=True))])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tetrad_trainer.export",
                                     description="Export a committed Tetrad checkpoint as a Hugging Face "
                                                 "directory.")
    parser.add_argument("checkpoint_dir",
                        help="the job's checkpoint.path (holding `latest` and step-* directories)")
    parser.add_argument("out_dir",
                        help="where config.json, the safetensors and the source's tokenizer files "
                             "are written")
    parser.add_argument("--step", type=int, default=None,
                        help="the step to export (default: the one `latest` names)")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="dtype of the weights (default: the source directory's torch_dtype, "
                             "else float32)")
    parser.add_argument("--source", default=None, metavar="HF_DIR",
                        help=f"the Hugging Face directory the model came from, for its config.json, "
                             f"generation config and tokenizer (default: CHECKPOINT_DIR/{SOURCE_DIR}, "
                             "kept by the trainer, else the job's spec.model.hfDir where it is readable)")
    parser.add_argument("--max-shard-size", type=int, default=MAX_SHARD_BYTES, metavar="BYTES",
                        help="split the weights into shards of at most this many bytes, with an index "
                             f"(default {MAX_SHARD_BYTES}, transformers')")
    args = parser.parse_args(argv)
    try:
        step_dir = export(args.checkpoint_dir, args.out_dir, step=args.step,
                          dtype=DTYPES[args.dtype] if args.dtype else None, source=args.source,
                          max_shard_bytes=args.max_shard_size)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"exported {step_dir} to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
