"""Llama-3-style model presets: the dims a preset name stands for."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, TypedDict


class ModelDims(TypedDict):
    dim: int
    layers: int
    heads: int
    kvHeads: int
    vocab: int
    ffnDim: int
    seqLen: int
    ropeTheta: float
    normEps: float


def _dims(dim: int, layers: int, heads: int, kv: int, vocab: int, ffn: int, seq: int, rope: float = 500000.0) -> ModelDims:
    return ModelDims(dim=dim, layers=layers, heads=heads, kvHeads=kv, vocab=vocab, ffnDim=ffn, seqLen=seq,
                     ropeTheta=rope, normEps=1e-5)


DEFAULT_PRESET: Final = "debug"  # a job that names no preset, no model of its own and not every dim
PRESETS: Final[dict[str, ModelDims]] = {
    # A few MB, fast on CPU; every degree used by the test matrix divides it.
    "debug": _dims(256, 4, 8, 4, 2048, 768, 256, rope=10000.0),
    "llama3-125m": _dims(768, 12, 12, 4, 32768, 2048, 2048),
    "llama3-1b": _dims(2048, 16, 32, 8, 128256, 8192, 2048),
    "llama3-8b": _dims(4096, 32, 32, 8, 128256, 14336, 8192),
    "llama3-70b": _dims(8192, 80, 64, 8, 128256, 28672, 8192),
    "llama3-405b": _dims(16384, 126, 128, 8, 128256, 53248, 8192),
}


SHAPE: Final = ("dim", "layers", "heads", "kvHeads", "vocab", "ffnDim")


def model_name(preset: str | None, dims: Mapping[str, Any]) -> str:
    """The model as people read it, everywhere it is named: the preset and the dims that differ
    from it ("llama3-1b (seqLen 8192)"), or "custom" without a known preset or when `dims` give
    every dim of the shape. `dims` are the explicit ones, camelCase."""
    base = PRESETS.get(preset) if preset is not None else None
    if base is None or all(k in dims for k in SHAPE):  # a preset that gives nothing but its seqLen, rope, eps
        return "custom"
    changed = [f"{k} {_number(v)}" for k in base if k in dims and (v := dims[k]) != base[k]]  # type: ignore[literal-required]
    return f"{preset} ({', '.join(changed)})" if changed else preset  # type: ignore[return-value]


def _number(v: Any) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)
