"""The built-in decoder's families and their Hugging Face config.json, both ways.

Llama, Mistral, Qwen2/2.5 and Qwen3 (and SmolLM, a Llama) are one pre-norm decoder (RMSNorm, RoPE,
grouped-query attention, SwiGLU) with options; a family is a few lines of config over it (FAMILIES):
its Hugging Face model_type and architecture, the options it always has (Qwen2's q/k/v biases,
Qwen3's per-head q/k RMSNorm), the defaults transformers gives keys a config.json leaves out, and
the keys of its modeling file that would change the forward pass away from Tetrad's block, each
refused by name with its value.

- `read_hf_config`: a config.json as spec.model fields (camelCase) and the refusals;
- `hf_differences`: where those fields contradict a resolved ModelConfig (the trainer's start-up
  check, the import);
- `write_hf_config`: the config.json of a ModelConfig, over the source's when the model came from
  one (its token ids, max_position_embeddings, generation settings and every other key kept).

Pure Python: the CLI (where it can read the directory), the trainer and the export share it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from tetrad.api.resolved import ModelConfig
from tetrad.api.spec import Family

ROPE_TYPES: Final = ("default", "llama3")  # implemented; linear, dynamic, yarn, longrope, ... are refused
DEFAULT_ROPE_THETA: Final = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta
LLAMA3_KEYS: Final = {"factor": "factor", "low_freq_factor": "lowFreqFactor",
                      "high_freq_factor": "highFreqFactor",
                      "original_max_position_embeddings": "originalMaxPositions"}


@dataclass(frozen=True)
class Refusal:
    """A config.json key whose value changes the forward pass in a way Tetrad's block does not implement."""

    key: str
    supported: Callable[[Any], bool]
    why: str


def _falsy(v: Any) -> bool:
    return not v


# Every family's modeling file reads these; Tetrad implements silu, no dropout, unquantized weights.
COMMON_REFUSALS: Final = (
    Refusal("hidden_act", lambda v: v == "silu", "Tetrad's block is SwiGLU with silu"),
    Refusal("attention_dropout", _falsy, "Tetrad trains without attention dropout"),
    Refusal("quantization_config", lambda v: v is None,
            "quantized weights are not supported; use the unquantized checkpoint"),
    Refusal("partial_rotary_factor", lambda v: v in (None, 1, 1.0), "Tetrad rotates the whole head"),
)
_BIAS = Refusal("attention_bias", _falsy,
                "biases on q, k, v and o; Tetrad's block has q/k/v biases in the qwen2 family only")
_MLP_BIAS = Refusal("mlp_bias", _falsy, "Tetrad's SwiGLU has no biases")
_WINDOW = Refusal("sliding_window", lambda v: v is None,
                  "sliding-window attention; Tetrad's attention is full causal")
_QWEN_WINDOW = Refusal("use_sliding_window", _falsy,
                       "sliding-window attention; Tetrad's attention is full causal")
_LAYER_TYPES = Refusal("layer_types", lambda v: v is None or set(v) <= {"full_attention"},
                       "layers of sliding-window attention; Tetrad's attention is full causal")


@dataclass(frozen=True)
class FamilyConfig:
    """One family: how its checkpoints name and configure the shared block."""

    family: Family
    model_type: str  # config.json's model_type
    architecture: str  # the transformers class that loads the export
    defaults: Mapping[str, Any]  # transformers' config defaults for keys a config.json leaves out
    refusals: tuple[Refusal, ...]  # beyond COMMON_REFUSALS
    # keys the export sets, so the reader gets Tetrad's block
    written: Mapping[str, Any] = field(default_factory=dict)
    qkv_bias: bool = False
    qk_norm: bool = False
    head_dim_default: int | None = None  # None: hidden_size / num_attention_heads


_LLAMA_DEFAULTS: Final = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                          "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
                          "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                          "tie_word_embeddings": False}
_QWEN_DEFAULTS: Final = {**_LLAMA_DEFAULTS, "vocab_size": 151936, "intermediate_size": 22016,
                         "num_key_value_heads": 32, "max_position_embeddings": 32768,
                         "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}

FAMILIES: Final[dict[Family, FamilyConfig]] = {
    Family.LLAMA: FamilyConfig(Family.LLAMA, "llama", "LlamaForCausalLM", _LLAMA_DEFAULTS, (_BIAS, _MLP_BIAS),
                               written={"attention_bias": False, "mlp_bias": False}),
    # transformers' Mistral defaults to a 4096-token sliding window when the key is absent
    Family.MISTRAL: FamilyConfig(Family.MISTRAL, "mistral", "MistralForCausalLM",
                                 {**_LLAMA_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8,
                                  "max_position_embeddings": 131072, "sliding_window": 4096},
                                 (_WINDOW,), written={"sliding_window": None}),
    Family.QWEN2: FamilyConfig(Family.QWEN2, "qwen2", "Qwen2ForCausalLM", _QWEN_DEFAULTS,
                               (_QWEN_WINDOW, _LAYER_TYPES),
                               written={"use_sliding_window": False}, qkv_bias=True),
    Family.QWEN3: FamilyConfig(Family.QWEN3, "qwen3", "Qwen3ForCausalLM", _QWEN_DEFAULTS,
                               (_BIAS, _QWEN_WINDOW, _LAYER_TYPES),
                               written={"attention_bias": False, "use_sliding_window": False}, qk_norm=True,
                               head_dim_default=128),
}
BY_MODEL_TYPE: Final = {f.model_type: f for f in FAMILIES.values()}

# spec.model field (camelCase) <- config.json key, for the dims read as they are
_DIM_KEYS: Final = {"dim": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
                    "kvHeads": "num_key_value_heads", "headDim": "head_dim", "vocab": "vocab_size",
                    "ffnDim": "intermediate_size", "ropeTheta": "rope_theta", "normEps": "rms_norm_eps",
                    "tieEmbeddings": "tie_word_embeddings", "ropeScaling": "rope_scaling",
                    "family": "model_type"}
# the ModelConfig attribute of each field
_ATTRS: Final = {"dim": "dim", "layers": "layers", "heads": "heads", "kvHeads": "kv_heads",
                 "headDim": "head_dim", "vocab": "vocab", "ffnDim": "ffn_dim", "ropeTheta": "rope_theta",
                 "normEps": "norm_eps", "tieEmbeddings": "tie_embeddings", "ropeScaling": "rope_scaling",
                 "family": "family"}
HF_FIELDS: Final = tuple(_DIM_KEYS)  # what a config.json decides of spec.model


def config_key(field_name: str) -> str:
    """The config.json key behind a spec.model field (camelCase)."""
    return _DIM_KEYS[field_name]


@dataclass
class HFModel:
    """What a config.json says of the model: spec.model fields, and what Tetrad refuses."""

    fields: dict[str, Any]  # camelCase spec.model fields, complete (HF_FIELDS) when problems is empty
    # max_position_embeddings (metadata: no forward-pass effect for default/llama3 RoPE)
    max_positions: int | None
    problems: list[str]  # "key=value: why", one per refused or unreadable key


def _rope_section(config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """(the key it came from, the RoPE parameters) as transformers reads them: rope_scaling wins over
    rope_parameters."""
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(config.get(key), Mapping) and config[key]:
            return key, config[key]
    return "rope_parameters", {}


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _positive(v: Any) -> bool:
    return _number(v) and v > 0


def read_hf_config(config: Mapping[str, Any]) -> HFModel:
    """spec.model fields from a Hugging Face config.json, with transformers' defaults for absent keys."""
    model_type = config.get("model_type")
    family = BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        known = ", ".join(sorted(BY_MODEL_TYPE))
        return HFModel({}, None,
                       [f"model_type={model_type!r}: not a family Tetrad's decoder implements ({known})"])
    c = {**family.defaults, **config}
    problems = [f"{r.key}={c.get(r.key)!r}: {r.why}" for r in (*COMMON_REFUSALS, *family.refusals)
                if not r.supported(c.get(r.key))]

    def integer(key: str) -> int:
        v = c.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            problems.append(f"{key}={v!r}: not a positive integer")
            return 1
        return v

    dim, heads = integer("hidden_size"), integer("num_attention_heads")
    kv = integer("num_key_value_heads") if c.get("num_key_value_heads") is not None else heads
    head_dim = (integer("head_dim") if c.get("head_dim") is not None
                else family.head_dim_default or dim // heads)
    rope_key, rope = _rope_section(c)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", c.get("rope_theta", DEFAULT_ROPE_THETA))
    if not _positive(theta):
        problems.append(f"rope_theta={theta!r}: not a positive number")
    eps = c.get("rms_norm_eps")
    if not _positive(eps):
        problems.append(f"rms_norm_eps={eps!r}: not a positive number")
    if rope.get("partial_rotary_factor", 1.0) not in (1, 1.0):
        problems.append(f"{rope_key}.partial_rotary_factor={rope['partial_rotary_factor']!r}: Tetrad rotates "
                        "the whole head")
    scaling = None
    if rope_type not in ROPE_TYPES:
        problems.append(f"{rope_key}.rope_type={rope_type!r}: Tetrad implements RoPE types "
                        f"{', '.join(ROPE_TYPES)}")
    elif rope_type == "llama3":
        if missing := [k for k in LLAMA3_KEYS if not _number(rope.get(k))]:
            problems.append(f"{rope_key}: rope_type llama3 needs {', '.join(missing)}")
        else:
            scaling = {"type": "llama3", **{ours: rope[k] for k, ours in LLAMA3_KEYS.items()}}
    tie = c.get("tie_word_embeddings")
    if not isinstance(tie, bool):
        problems.append(f"tie_word_embeddings={tie!r}: not true or false")
    fields = {"family": family.family.value, "dim": dim, "layers": integer("num_hidden_layers"),
              "heads": heads, "kvHeads": kv, "headDim": head_dim, "vocab": integer("vocab_size"),
              "ffnDim": integer("intermediate_size"), "ropeTheta": theta, "ropeScaling": scaling,
              "normEps": eps, "tieEmbeddings": tie}
    max_positions = c.get("max_position_embeddings")
    return HFModel(fields, max_positions if isinstance(max_positions, int) else None, problems)


def model_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The HF_FIELDS of a resolved model, camelCase, as read_hf_config gives them."""
    out = {f: getattr(cfg, attr) for f, attr in _ATTRS.items()}
    out["family"] = cfg.family.value if cfg.family is not None else None
    out["ropeScaling"] = cfg.rope_scaling.model_dump(by_alias=True) if cfg.rope_scaling is not None else None
    return out


def hf_differences(fields: Mapping[str, Any], cfg: ModelConfig) -> list[str]:
    """Where a config.json (read_hf_config's fields) contradicts the resolved model:
    "key hf != ours (spec.model.f)"."""
    ours = model_fields(cfg)
    return [f"{config_key(f)} {_shown(fields[f])} != {_shown(ours[f])} (spec.model.{f})"
            for f in HF_FIELDS if f in fields and fields[f] != ours[f]]


def _shown(v: Any) -> str:
    return repr(v) if isinstance(v, str | dict) else str(v)


def write_hf_config(cfg: ModelConfig, *, dtype: str,
                    source: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config.json of cfg's model for its family's transformers class, over the source's config.json when
    the model came from one: every key Tetrad does not own (token ids, max_position_embeddings, ...) kept."""
    if cfg.family is None:
        raise ValueError(f"the model is spec.model.module={cfg.module}: Hugging Face conversion covers the "
                         "built-in families")
    family = FAMILIES[cfg.family]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if (s := cfg.rope_scaling) is not None:
        rope = {"rope_type": s.type, "rope_theta": cfg.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_positions}
    out = dict(source or {})
    out.pop("dtype", None)  # transformers 5 writes it; torch_dtype below says the same
    out.update(family.written)
    out.update({
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        # transformers 5 reads rope_parameters; 4.x and vLLM rope_theta and rope_scaling (None: plain RoPE)
        "rope_theta": cfg.rope_theta,
        "rope_scaling": ({k: v for k, v in rope.items() if k != "rope_theta"}
                         if cfg.rope_scaling is not None else None),
        "rope_parameters": rope,
        "torch_dtype": dtype,
    })
    out.setdefault("max_position_embeddings", cfg.seq_len)
    return out
