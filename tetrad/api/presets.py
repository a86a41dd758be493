"""Model presets: the family and dims a preset name stands for.

The Llama-3-style presets (debug, llama3-*) are sizes for training from scratch; the others carry the
published config.json values of the checkpoints people fine-tune (Llama 3.1/3.2, Llama 2, Qwen2.5,
Qwen3, Mistral v0.3, SmolLM2), so a job naming one with `hfDir` validates and plans without the
weights, and every rank checks the directory's config.json against it at start-up. seqLen is the
training sequence length, not the checkpoint's max_position_embeddings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, TypedDict


class RopeScalingDims(TypedDict):
    type: str
    factor: float
    lowFreqFactor: float
    highFreqFactor: float
    originalMaxPositions: int


class ModelDims(TypedDict):
    family: str
    dim: int
    layers: int
    heads: int
    kvHeads: int
    headDim: int
    vocab: int
    ffnDim: int
    seqLen: int
    ropeTheta: float
    ropeScaling: RopeScalingDims | None
    normEps: float
    tieEmbeddings: bool


def _dims(dim: int, layers: int, heads: int, kv: int, vocab: int, ffn: int, seq: int,
          rope: float = 500000.0, *, family: str = "llama", head_dim: int | None = None, eps: float = 1e-5,
          tie: bool = False, scaling: RopeScalingDims | None = None) -> ModelDims:
    return ModelDims(family=family, dim=dim, layers=layers, heads=heads, kvHeads=kv,
                     headDim=head_dim or dim // heads, vocab=vocab, ffnDim=ffn, seqLen=seq, ropeTheta=rope,
                     ropeScaling=scaling, normEps=eps, tieEmbeddings=tie)


def _llama3(factor: float) -> RopeScalingDims:
    """Llama 3.1 and 3.2's rope_scaling (rope_type llama3)."""
    return RopeScalingDims(type="llama3", factor=factor, lowFreqFactor=1.0, highFreqFactor=4.0,
                           originalMaxPositions=8192)


def _qwen3(dim: int, layers: int, heads: int, ffn: int, tie: bool) -> ModelDims:
    return _dims(dim, layers, heads, 8, 151936, ffn, 4096, 1e6, family="qwen3", head_dim=128, eps=1e-6,
                 tie=tie)


def _qwen25(dim: int, layers: int, heads: int, kv: int, vocab: int, ffn: int, tie: bool) -> ModelDims:
    return _dims(dim, layers, heads, kv, vocab, ffn, 4096, 1e6, family="qwen2", eps=1e-6, tie=tie)


def _smollm2(dim: int, layers: int, heads: int, kv: int, ffn: int, rope: float) -> ModelDims:
    return _dims(dim, layers, heads, kv, 49152, ffn, 2048, rope, tie=True)


DEFAULT_PRESET: Final = "debug"  # a job that names no preset, no model of its own and not every dim
PRESETS: Final[dict[str, ModelDims]] = {
    # A few MB, fast on CPU; every degree used by the test matrix divides it.
    "debug": _dims(256, 4, 8, 4, 2048, 768, 256, rope=10000.0),
    "llama3-125m": _dims(768, 12, 12, 4, 32768, 2048, 2048),
    "llama3-1b": _dims(2048, 16, 32, 8, 128256, 8192, 2048),
    "llama3-8b": _dims(4096, 32, 32, 8, 128256, 14336, 8192),
    "llama3-70b": _dims(8192, 80, 64, 8, 128256, 28672, 8192),
    "llama3-405b": _dims(16384, 126, 128, 8, 128256, 53248, 8192),
    # Published checkpoints (their config.json values; seqLen a training length).
    "llama2-7b": _dims(4096, 32, 32, 32, 32000, 11008, 4096, 10000.0),
    "llama3.1-8b": _dims(4096, 32, 32, 8, 128256, 14336, 8192, scaling=_llama3(8.0)),
    "llama3.1-70b": _dims(8192, 80, 64, 8, 128256, 28672, 8192, scaling=_llama3(8.0)),
    "llama3.2-1b": _dims(2048, 16, 32, 8, 128256, 8192, 4096, tie=True, scaling=_llama3(32.0)),
    "llama3.2-3b": _dims(3072, 28, 24, 8, 128256, 8192, 4096, head_dim=128, tie=True, scaling=_llama3(32.0)),
    "mistral-7b": _dims(4096, 32, 32, 8, 32768, 14336, 4096, 1e6, family="mistral"),
    "qwen2.5-0.5b": _qwen25(896, 24, 14, 2, 151936, 4864, tie=True),
    "qwen2.5-1.5b": _qwen25(1536, 28, 12, 2, 151936, 8960, tie=True),
    "qwen2.5-7b": _qwen25(3584, 28, 28, 4, 152064, 18944, tie=False),
    "qwen3-0.6b": _qwen3(1024, 28, 16, 3072, tie=True),
    "qwen3-1.7b": _qwen3(2048, 28, 16, 6144, tie=True),
    "qwen3-4b": _qwen3(2560, 36, 32, 9728, tie=True),
    "qwen3-8b": _qwen3(4096, 36, 32, 12288, tie=False),
    "smollm2-135m": _smollm2(576, 30, 9, 3, 1536, 100000.0),
    "smollm2-360m": _smollm2(960, 32, 15, 5, 2560, 100000.0),
    "smollm2-1.7b": _smollm2(2048, 24, 32, 32, 8192, 130000.0),
}


SHAPE: Final = ("dim", "layers", "heads", "kvHeads", "vocab", "ffnDim")


def model_name(preset: str | None, dims: Mapping[str, Any]) -> str:
    """The model as people read it, everywhere it is named: the preset and the dims that differ
    from it ("llama3-1b (seqLen 8192)"), or "custom" without a known preset or when `dims` give
    every dim of the shape. `dims` are the explicit ones, camelCase."""
    base = PRESETS.get(preset) if preset is not None else None
    if base is None or all(k in dims for k in SHAPE):  # a preset that gives nothing but its seqLen, rope, eps
        return "custom"
    changed = [f"{k} {_number(v)}" for k in base
               if k in dims and (v := dims[k]) != base[k]]  # type: ignore[literal-required]
    return f"{preset} ({', '.join(changed)})" if changed else preset  # type: ignore[return-value]


def _number(v: Any) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)
