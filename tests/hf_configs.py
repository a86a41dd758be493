"""Published config.json values of the checkpoints people fine-tune, as on the Hugging Face Hub (no
download here: written down from the model repositories' files), and their shrunk test copies.

`shrunk` keeps every feature that changes the arithmetic (head_dim, including a head_dim that is not
hidden/heads, the GQA ratio, RoPE theta and scaling, tying, biases, norms, eps, the key layout of the
file: a Llama 2 without rope_theta stays without it) and makes the model small enough for the CPU:
2 layers, 2 kv heads, a 512-token vocabulary (token ids taken modulo it), an MLP as wide as the hidden size.
"""

from __future__ import annotations

import copy
from typing import Any

_LLAMA31_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192, "rope_type": "llama3"}

PUBLISHED: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-2-7b-hf: no rope_theta key (transformers defaults it to 10000)
    "llama2-7b": {
        "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008,
        "max_position_embeddings": 4096, "model_type": "llama", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 32, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "float16",
        "transformers_version": "4.31.0.dev0", "use_cache": True, "vocab_size": 32000},
    # meta-llama/Llama-3.1-8B
    "llama3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": _LLAMA31_SCALING, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0", "use_cache": True,
        "vocab_size": 128256},
    # meta-llama/Llama-3.2-1B: tied, rope factor 32, an explicit head_dim
    "llama3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
        "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05, "rope_scaling": {**_LLAMA31_SCALING, "factor": 32.0}, "rope_theta": 500000.0,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.45.0.dev0",
        "use_cache": True, "vocab_size": 128256},
    # mistralai/Mistral-7B-v0.3: no sliding window
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.42.0.dev0", "use_cache": True,
        "vocab_size": 32768},
    # Qwen/Qwen2.5-7B: q/k/v biases, GQA 7:1, an inert sliding_window
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
        "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
        "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.1",
        "use_cache": True, "use_mrope": False, "use_sliding_window": False, "vocab_size": 152064},
    # Qwen/Qwen2.5-0.5B: the same, tied
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
        "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
        "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936},
    # Qwen/Qwen3-0.6B: q/k norms, head_dim 128 with hidden/heads 64, tied
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
        "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936},
    # Qwen/Qwen3-8B: untied
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
        "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
        "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936},
    # HuggingFaceTB/SmolLM2-135M: a Llama, tied, 9 heads over 3 kv heads
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 576,
        "initializer_range": 0.041666666666666664, "intermediate_size": 1536, "is_llama_config": True,
        "max_position_embeddings": 8192, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 9,
        "num_hidden_layers": 30, "num_key_value_heads": 3, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True, "vocab_size": 49152},
}
# The preset of each published checkpoint (its dims must be the config.json's).
PRESET_OF = {name: name for name in PUBLISHED}


def shrunk(config: dict[str, Any], *, kv_heads: int = 2, layers: int = 2, vocab: int = 512) -> dict[str, Any]:
    """A small copy of a published config with every arithmetic feature kept (see the module's doc)."""
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    ratio = heads // (config.get("num_key_value_heads") or heads)
    per_head = hidden // heads  # hidden/heads, which an explicit head_dim may differ from (Qwen3)
    new_heads = kv_heads * ratio
    small = dict(copy.deepcopy(config), num_hidden_layers=layers, num_attention_heads=new_heads,
                 num_key_value_heads=kv_heads, hidden_size=new_heads * per_head,
                 intermediate_size=new_heads * per_head, vocab_size=vocab)
    if "max_window_layers" in config:
        small["max_window_layers"] = layers
    for key in ("bos_token_id", "eos_token_id"):
        if isinstance(config.get(key), int):
            small[key] = config[key] % vocab
    return small
