"""The resolved trainer config: every `auto` solved, every preset expanded.

The trainer reads it, with the pod contract (tetrad.api.contract), and checks it again with the
shared rules (tetrad.api.rules). The operator ships it in a ConfigMap, `tetrad run` writes it to a
file; both come from `resolve()` in `tetrad.resolve`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from tetrad.api.spec import (
    COLLECTIVE_TIMEOUT_SECONDS,
    CamelModel,
    Checkpoint,
    Data,
    Family,
    Metrics,
    PPSchedule,
    Preflight,
    RopeScaling,
    Script,
    Training,
)

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class Layout(CamelModel):
    """A concrete 4D layout. Its mesh dims, outermost first, are MESH_DIMS."""

    model_config = CamelModel.model_config | {"frozen": True}
    pp: int = Field(1, ge=1, description="Pipeline degree.")
    dp_replicate: int = Field(1, ge=1, description="Data-parallel replicate degree.")
    dp_shard: int = Field(1, ge=1, description="Data-parallel shard degree.")
    cp: int = Field(1, ge=1, description="Context-parallel degree.")
    tp: int = Field(1, ge=1, description="Tensor-parallel degree.")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in MESH_DIMS)

    def label(self) -> str:
        return f"pp{self.pp}.dpr{self.dp_replicate}.dps{self.dp_shard}.cp{self.cp}.tp{self.tp}"


class ModelConfig(CamelModel):
    """The model's dims and options: everything the trainer builds it from, the planner counts and the
    Hugging Face conversion writes (tetrad.api.families)."""

    name: str = Field(description="The preset and the dims that override it, e.g. 'llama3-1b (seqLen 8192)', "
                      "'custom' (tetrad.api.presets.model_name), or a plug-in's import path.")
    module: str | None = Field(None, description="A plug-in model definition's import path "
                               "(spec.model.module); None: the built-in decoder.")
    family: Family | None = Field(Family.LLAMA, strict=False, description="The built-in decoder's family "
                                  "(tetrad.api.families); None for a plug-in.")
    hf_dir: str | None = Field(None, description="The Hugging Face directory in the pod the model starts "
                               "from (spec.model.hfDir, or training.initFrom); None: the seed's weights.")
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int = Field(description="Dimension of one attention head (dim / heads unless given).")
    vocab: int
    ffn_dim: int
    seq_len: int
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    norm_eps: float
    tie_embeddings: bool = Field(False, description="The output projection is the token embedding.")
    qkv_bias: bool = Field(False, description="The q, k and v projections have biases (the family's: Qwen2).")
    qk_norm: bool = Field(False, description="RMSNorm over head_dim of every query and key head before RoPE "
                          "(the family's: Qwen3).")

    @model_validator(mode="before")
    @classmethod
    def _default_head_dim(cls, data: Any) -> Any:
        """Configs written before head_dim was a field (checkpoints' manifests) have dim / heads."""
        if isinstance(data, dict) and "head_dim" not in data and "headDim" not in data and data.get("heads"):
            return {**data, "headDim": data["dim"] // data["heads"]}
        return data

    def block_params(self) -> int:
        """Parameters of one block: attention (with its biases and q/k norms), the SwiGLU MLP, two norms."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = 2 * self.dim * q + 2 * self.dim * kv
        attn += (q + 2 * kv) if self.qkv_bias else 0
        attn += 2 * self.head_dim if self.qk_norm else 0
        return attn + 3 * self.dim * self.ffn_dim + 2 * self.dim

    def num_params(self, *, include_embedding: bool = True) -> int:
        """Parameter count of the built-in decoder, a tied embedding and output counted once.
        include_embedding=False leaves out an embedding table that is only looked up (untied): what
        the 6N of the FLOPs counts."""
        # blocks, final norm, output
        params = self.layers * self.block_params() + self.dim + self.vocab * self.dim
        return params + (self.vocab * self.dim if include_embedding and not self.tie_embeddings else 0)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 6N (non-embedding) + 12*L*H*Q*T attention."""
        return 6.0 * self.num_params(include_embedding=False) + self.attention_flops_per_token(seq_len)

    def attention_flops_per_token(self, seq_len: int | None = None) -> float:
        """The attention part of flops_per_token: 12*L*H*Q*T, forward and backward, causal or not."""
        return 12.0 * self.layers * self.heads * self.head_dim * (seq_len or self.seq_len)


class ResolvedConfig(CamelModel):
    job_name: str = Field(description="The job's name.")
    namespace: str = Field("default", description="The job's namespace.")
    nodes: int
    nproc_per_node: int
    layout: Layout
    pp_schedule: PPSchedule = PPSchedule.ONE_F_ONE_B
    pp_microbatches: int = Field(1, ge=1)
    pp_stages_per_rank: int = Field(1, ge=1)
    model: ModelConfig | None = Field(description="The model Tetrad's trainer builds; None for a script job.")
    script: Script | None = Field(None, description="A script job's entry point (spec.script); None: "
                                  "Tetrad's trainer.")
    training: Training
    data: Data
    checkpoint: Checkpoint
    metrics: Metrics
    gpu_type: str | None = None
    use_gpu: bool = Field(False, description="Pods request GPUs; the trainer still falls back to CPU when "
                          "none is visible.")
    cpus: float | None = Field(None, description="CPUs each node's pod requests (resources.cpu); the "
                               "preflight gate checks they are there. None: no request.")
    preflight: Preflight = Field(default_factory=Preflight, description="The preflight gate's settings.")
    predicted_peak_bytes: float | None = Field(None, description="The planner's predicted peak memory per "
                                               "device, in bytes, quoted by the trainer when the device runs "
                                               "out of memory; None when not planned.")
    collective_timeout_seconds: int = Field(
        COLLECTIVE_TIMEOUT_SECONDS, ge=1,
        description="The process groups' collective timeout (spec.runPolicy.collectiveTimeoutSeconds).")

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, indent=2)

    @classmethod
    def load(cls, path: str | Path) -> ResolvedConfig:
        # JSON mode: the strict model takes enums from their string values there, as the file holds them
        return cls.model_validate_json(Path(path).read_text())
