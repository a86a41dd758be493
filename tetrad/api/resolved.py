"""The resolved trainer config: every `auto` solved, every preset expanded.

The trainer reads it, with the pod contract (tetrad.api.contract), and checks it again with the
shared rules (tetrad.api.rules). The operator ships it in a ConfigMap, `tetrad run` writes it to a
file; both come from `resolve()` in `tetrad.resolve`.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from tetrad.api.spec import (
    COLLECTIVE_TIMEOUT_SECONDS,
    CamelModel,
    Checkpoint,
    Data,
    Metrics,
    PPSchedule,
    Preflight,
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
    name: str = Field(description="The preset and the dims that override it, e.g. 'llama3-1b (seqLen 8192)', 'custom' (tetrad.api.presets.model_name), or a plug-in's import path.")
    module: str | None = Field(None, description="A plug-in model definition's import path (spec.model.module); None: the built-in Llama.")
    dim: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    ffn_dim: int
    seq_len: int
    rope_theta: float
    norm_eps: float

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def num_params(self, *, include_embedding: bool = True) -> int:
        """Parameter count of the Llama model (untied embedding and output)."""
        kv_dim = self.kv_heads * self.head_dim
        attn = self.dim * self.dim * 2 + self.dim * kv_dim * 2
        ffn = 3 * self.dim * self.ffn_dim
        block = attn + ffn + 2 * self.dim
        params = self.layers * block + self.dim + self.vocab * self.dim  # blocks, final norm, output
        return params + (self.vocab * self.dim if include_embedding else 0)

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
    script: Script | None = Field(None, description="A script job's entry point (spec.script); None: Tetrad's trainer.")
    training: Training
    data: Data
    checkpoint: Checkpoint
    metrics: Metrics
    gpu_type: str | None = None
    use_gpu: bool = Field(False, description="Pods request GPUs; the trainer still falls back to CPU when none is visible.")
    cpus: float | None = Field(None, description="CPUs each node's pod requests (resources.cpu); the preflight gate checks they are there. None: no request.")
    preflight: Preflight = Field(default_factory=Preflight, description="The preflight gate's settings.")
    predicted_peak_bytes: float | None = Field(None, description="The planner's predicted peak memory per device, in bytes, quoted by the trainer when the device runs out of memory; None when not planned.")
    collective_timeout_seconds: int = Field(COLLECTIVE_TIMEOUT_SECONDS, ge=1, description="The process groups' collective timeout (spec.runPolicy.collectiveTimeoutSeconds).")

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, indent=2)

    @classmethod
    def load(cls, path: str | Path) -> ResolvedConfig:
        # JSON mode: the strict model takes enums from their string values there, as the file holds them
        return cls.model_validate_json(Path(path).read_text())
