"""The ParallelTrainingJob model: one source of truth for the CRD, validation, renderer and trainer.

Field names are Kubernetes camelCase on the wire (aliases) and snake_case in Python.
Every field carries a description: it becomes `kubectl explain` text in the generated CRD.
"""

from __future__ import annotations

import re
import shlex
from enum import StrEnum
from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from tetrad.api.contract import API_VERSION, CONFIG_DIR, EXIT_CONFIG_ERROR, EXIT_OOM, KIND

Auto = Literal["auto"]
Degree = Annotated[int | Auto, Field(json_schema_extra={"x-kubernetes-int-or-string": True})]


MAX_NODES: Final = 100000
# The default of runPolicy.collectiveTimeoutSeconds: below the stall detector's 300 s floor, so a hung
# collective ends as CollectiveTimeout, naming the peers, before the operator restarts the gang as Stalled.
COLLECTIVE_TIMEOUT_SECONDS: Final = 240
# Kubernetes limits (k8s.io/apimachinery/pkg/util/validation).
DNS1123_LABEL_MAX: Final = 63
DNS1035_LABEL: Final = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# The job's name becomes the Service, the label value tetrad.dev/job-name and, with "-<rank>"
# appended, each pod's hostname: all DNS labels of at most 63 characters.
# tests/api/test_hostile.py checks every name in tetrad/render/names.py against this room.
JOB_NAME_MAX: Final = DNS1123_LABEL_MAX - len(f"-{MAX_NODES - 1}")


def _job_name(name: str) -> str:
    if not name:
        raise ValueError("metadata.name is required; set a DNS-1035 label such as my-job")
    if len(name) > JOB_NAME_MAX:
        raise ValueError(f"name is {len(name)} characters; at most {JOB_NAME_MAX} leave room for the pods' "
                         f"hostname suffix -<rank> within Kubernetes' 63-character DNS label")
    if not DNS1035_LABEL.fullmatch(name):
        raise ValueError("name must be a DNS-1035 label: lowercase letters, digits and '-', starting with a "
                         "letter and ending with a letter or digit, e.g. my-job")
    return name


def _namespace(name: str) -> str:
    if len(name) > DNS1123_LABEL_MAX or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name):
        raise ValueError("namespace must be a DNS-1123 label (lowercase letters, digits, '-', at most 63)")
    return name


# checkpoint.path: absolute and normalized (no '//', '.', '..', trailing '/'), not /, and apart from
# the config mount (neither CONFIG_DIR, under it, nor above it). The CRD carries the same rule in CEL.
_ABSOLUTE_NORMAL: Final = r"^(/[^/]+)+$"
_DOT_COMPONENT: Final = r"/[.][.]?(/|$)"
CHECKPOINT_PATH_RULE: Final = {
    "rule": f"self.matches('{_ABSOLUTE_NORMAL}') && !self.matches('{_DOT_COMPONENT}') && self != "
            f"'{CONFIG_DIR}' && !self.startsWith('{CONFIG_DIR}/') && !'{CONFIG_DIR}'.startsWith(self + '/')",
    "message": "spec.checkpoint.path must be an absolute, normalized directory other than / that does not "
               f"overlap {CONFIG_DIR}, e.g. /checkpoints",
}


def _checkpoint_path(path: str) -> str:
    if not re.search(_ABSOLUTE_NORMAL, path) or re.search(_DOT_COMPONENT, path):
        raise ValueError("checkpoint.path must be an absolute, normalized directory other than / (no '//', "
                         "'.', '..' or trailing '/'), e.g. /checkpoints")
    if path == CONFIG_DIR or path.startswith(CONFIG_DIR + "/") or CONFIG_DIR.startswith(path + "/"):
        raise ValueError(f"checkpoint.path overlaps {CONFIG_DIR}, where the pod's config is mounted; use "
                         "e.g. /checkpoints")
    return path


def _hf_dir(field: str, example: str) -> AfterValidator:
    """A Hugging Face model directory inside the pod: absolute and normalized, like checkpoint.path."""
    def check(path: str | None) -> str | None:
        if path is not None and (not re.search(_ABSOLUTE_NORMAL, path) or re.search(_DOT_COMPONENT, path)):
            raise ValueError(f"{field} must be the absolute, normalized path inside the pod of a Hugging Face"
                             f" model directory (no '//', '.', '..' or trailing '/'), e.g. {example}")
        return path
    return AfterValidator(check)


def _image(image: str) -> str:
    if not image or image != image.strip() or any(c.isspace() for c in image):
        raise ValueError("image must be a non-empty container image reference without whitespace")
    return image


class CamelModel(BaseModel):
    """Base of the API objects: camelCase on the wire, snake_case in Python, unknown fields rejected.

    Strict like the CRD: no coercion ("2" is not an integer, 1 is not a boolean), finite numbers only.
    Enums are validated from their string values (`strict=False` on those fields alone).
    """

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", strict=True,
                              allow_inf_nan=False)


class PPSchedule(StrEnum):
    GPIPE = "GPipe"
    ONE_F_ONE_B = "1F1B"
    INTERLEAVED_1F1B = "Interleaved1F1B"
    ZERO_BUBBLE = "ZeroBubble"


class Parallelism(CamelModel):
    dp_replicate: Degree = Field(1, description="Data-parallel replicate degree (DDP, or the replicate dim "
                                 "of HSDP). An integer >= 1 or 'auto'.")
    dp_shard: Degree = Field("auto", description="Data-parallel shard degree (FSDP2). An integer >= 1 or "
                             "'auto'; 'auto' takes whatever the other degrees leave.")
    tp: Degree = Field(1, description="Tensor-parallel degree, with sequence parallel on the norms. Must "
                       "divide heads and kvHeads; keep it within a node. An integer >= 1 or 'auto'.")
    cp: Degree = Field(1, description="Context-parallel degree: the sequence is split into 2*cp "
                       "load-balanced chunks. An integer >= 1 or 'auto'.")
    pp: Degree = Field(1, description="Pipeline-parallel degree (number of ranks in a pipeline). An "
                       "integer >= 1 or 'auto'.")
    pp_schedule: PPSchedule = Field(PPSchedule.ONE_F_ONE_B, strict=False, description="Pipeline schedule: "
                                    "GPipe, 1F1B, Interleaved1F1B (several stages per rank) or ZeroBubble.")
    pp_microbatches: int | None = Field(None, ge=1, description="Pipeline microbatches per step and "
                                        "data-parallel rank. Must be at least the number of pipeline stages. "
                                        "Defaults to the number of stages.")
    pp_stages_per_rank: int | None = Field(None, ge=1, description="Pipeline stages held by each rank. "
                                           "Defaults to 2 for Interleaved1F1B and ZeroBubble, 1 otherwise.")


# A plug-in model's import path in the image: a dotted module, ':', the object's name.
PLUGIN_PATH: Final = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
# A Python module run as `python -m MODULE`.
PYTHON_MODULE: Final = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"


def _python_module(name: str | None) -> str | None:
    if name is not None and not re.fullmatch(PYTHON_MODULE, name):
        raise ValueError("must be a dotted Python module name, e.g. mypkg.train")
    return name


def _plugin_path(path: str | None) -> str | None:
    if path is not None and not re.fullmatch(PLUGIN_PATH, path):
        raise ValueError("must be MODULE:NAME, the import path of a model definition in the image, e.g. "
                         "mypkg.models:gpt2")
    return path


class Family(StrEnum):
    """The built-in decoder's families (tetrad.api.families): one pre-norm RMSNorm/RoPE/SwiGLU block with
    options."""

    LLAMA = "llama"
    MISTRAL = "mistral"
    QWEN2 = "qwen2"
    QWEN3 = "qwen3"


class RopeScaling(CamelModel):
    """Llama 3.1's RoPE frequency scaling (Hugging Face rope_type llama3)."""

    type: Literal["llama3"] = Field(description="The scaling: llama3 (Llama 3.1, 3.2). Other Hugging Face "
                                    "rope types (linear, dynamic, yarn, longrope) are refused.")
    factor: float = Field(ge=1, description="Low frequencies are divided by this (8 for Llama 3.1, 32 "
                          "for Llama 3.2).")
    low_freq_factor: float = Field(gt=0, description="Wavelengths above originalMaxPositions / lowFreqFactor "
                                   "are scaled fully (1 for Llama 3.1).")
    high_freq_factor: float = Field(gt=0, description="Wavelengths below originalMaxPositions / "
                                    "highFreqFactor are kept (4 for Llama 3.1); the band between is "
                                    "interpolated. Must exceed lowFreqFactor.")
    original_max_positions: int = Field(ge=1, description="The context length the model was pretrained at "
                                        "(Hugging Face original_max_position_embeddings, "
                                        "8192 for Llama 3.1).")


class ModelSpec(CamelModel):
    preset: str | None = Field(None, description="Model preset (tetrad.api.presets), e.g. llama3.1-8b, "
                               "llama3.2-1b, qwen3-1.7b, qwen2.5-7b, mistral-7b, smollm2-360m, or the "
                               "Llama-3-style debug, llama3-125m ... llama3-405b. Explicit dims below "
                               "override the preset's. Without a preset, module or every dim: debug.")
    module: Annotated[str | None, AfterValidator(_plugin_path)] = Field(
        None, json_schema_extra={"pattern": PLUGIN_PATH}, description=(
            "Your own model in Tetrad's trainer: the import path, in the image, of its "
            "tetrad_trainer.models.ModelDefinition, e.g. mypkg.models:gpt2 (docs/bring-your-own.md). Needs "
            "dim, layers, heads, vocab and seqLen; kvHeads defaults to heads, ffnDim to 4 x dim. Not with "
            "preset, family or hfDir."))
    hf_dir: Annotated[str | None, _hf_dir("model.hfDir", "/models/qwen3-1.7b")] = Field(
        None, json_schema_extra={"pattern": _ABSOLUTE_NORMAL}, description=(
            "A Hugging Face model directory inside the pod (config.json, *.safetensors; e.g. on a PVC "
            "mounted through template.volumes): the model to fine-tune, its initial weights unless a "
            "checkpoint is resumed. The cluster cannot read it: give a preset, or family and every dim "
            "(tetrad validate, plan and run fill them from config.json where the directory is readable). "
            "Every rank checks config.json against the resolved model before training; a contradiction exits "
            "78 naming the field (docs/models.md)."))
    family: Family | None = Field(None, strict=False, description="The decoder family: llama (also SmolLM), "
                                  "mistral, qwen2 (Qwen2, Qwen2.5: q/k/v biases) or qwen3 (per-head q/k "
                                  "RMSNorm). Defaults to the preset's; llama without one.")
    dim: int | None = Field(None, ge=8, description="Hidden size.")
    layers: int | None = Field(None, ge=1, description="Number of transformer blocks.")
    heads: int | None = Field(None, ge=1, description="Attention heads.")
    kv_heads: int | None = Field(None, ge=1,
                                 description="Key/value heads (grouped-query attention). Must divide heads.")
    head_dim: int | None = Field(None, ge=2, description="Dimension of one attention head (Qwen3's differs "
                                 "from dim / heads). Defaults to the preset's, or to dim / heads when dim or "
                                 "heads is given. Even (RoPE rotates pairs).")
    vocab: int | None = Field(None, ge=2, description="Vocabulary size.")
    ffn_dim: int | None = Field(None, ge=1, description="SwiGLU feed-forward hidden size.")
    seq_len: int | None = Field(None, ge=2, description="Training sequence length in tokens.")
    rope_theta: float | None = Field(None, gt=0, description="RoPE base frequency.")
    rope_scaling: RopeScaling | None = Field(None, description="RoPE frequency scaling (Llama 3.1, 3.2); "
                                             "none by default.")
    norm_eps: float | None = Field(None, gt=0, description="RMSNorm epsilon.")
    tie_embeddings: bool | None = Field(None, description="The output projection is the token embedding "
                                        "(Llama 3.2, SmolLM2, small Qwens). Defaults to the preset's; false "
                                        "without one.")


class Precision(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"


class ActivationCheckpointing(StrEnum):
    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"


class LRSchedule(StrEnum):
    COSINE = "cosine"
    LINEAR = "linear"
    CONSTANT = "constant"


class Offload(StrEnum):
    NONE = "none"
    CPU = "cpu"


class Float8Recipe(StrEnum):
    NONE = "none"
    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    ROWWISE_WITH_GW_HP = "rowwise_with_gw_hp"


class Float8(CamelModel):
    recipe: Float8Recipe = Field(Float8Recipe.NONE, strict=False, description=(
        "none, or the torchao float8 training recipe of the linear layers: tensorwise (one scale per "
        "tensor; under FSDP the parameters are also all-gathered in float8), rowwise (one scale per row, "
        "closer to bf16's numerics) or rowwise_with_gw_hp (rowwise, the weight gradient in bf16). Needs "
        "NVIDIA GPUs of compute capability 8.9 or newer (H100, H200, L4, L40S, B200), compile: true, "
        "precision: bf16 and tp: 1, and torchao in the image."))
    output: bool = Field(False, description="Also run the output projection in float8 (false: it stays in "
                         "bf16, the usual choice: the logits are the most sensitive to rounding).")


class Fsdp(CamelModel):
    reshard_after_forward: bool = Field(True, description="true (ZeRO-3, the default): each FSDP unit frees "
                                        "its gathered parameters after its forward and gathers them again "
                                        "for its backward. false (ZeRO-2 behaviour): they stay gathered from "
                                        "the forward to the backward, one all-gather per microbatch instead "
                                        "of two, for the whole model's parameters in compute precision "
                                        "resident at the peak. Pipeline stages always keep them (false). "
                                        "Needs dpShard*cp > 1.")
    offload: Offload = Field(Offload.NONE, strict=False, description="none, or cpu: the sharded parameters, "
                             "gradients and AdamW state live in host memory (pinned on CUDA) and the "
                             "optimizer steps on the CPU; each unit's shard is copied to the device for its "
                             "all-gather. Cuts device memory to the gathered units and the activations, at "
                             "the cost of host-device transfers and a CPU optimizer step. Needs "
                             "dpShard*cp > 1.")


class Training(CamelModel):
    steps: int = Field(100, ge=1, description="Optimizer steps to train for.")
    global_batch: int = Field(8, ge=1,
                              description="Sequences per optimizer step across all data-parallel ranks.")
    micro_batch: int = Field(1, ge=1, description="Sequences per forward pass on one data-parallel rank "
                             "(gradient accumulation fills the rest). With pipeline parallelism the per-rank "
                             "batch is split into ppMicrobatches instead.")
    lr: float = Field(3e-4, gt=0, description="Peak learning rate of AdamW.")
    min_lr: float = Field(3e-5, ge=0, description="Learning rate at the end of the decay.")
    warmup_steps: int = Field(10, ge=0, description="Linear warmup steps.")
    lr_schedule: LRSchedule = Field(LRSchedule.COSINE, strict=False,
                                    description="Decay after warmup: cosine, linear or constant.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, ge=0,
                             description="Clip the global gradient norm to this value; 0 disables clipping.")
    seed: int = Field(0, ge=0, description="Seed for weights and synthetic data; the same seed gives the "
                      "same run for every layout.")
    precision: Precision = Field(Precision.BF16, strict=False, description="Compute precision: bf16 (bf16 "
                                 "params, fp32 reduce and master weights) or fp32.")
    activation_checkpointing: ActivationCheckpointing = Field(
        ActivationCheckpointing.NONE, strict=False,
        description="Activation checkpointing: none, full (every block) or selective (every other block).")
    compile: bool = Field(False, description="torch.compile each transformer block.")
    float8: Float8 = Field(default_factory=Float8, description="float8 matmuls in the linear layers "
                           "(torchao), about 1.2-1.5x bf16's throughput on Hopper GPUs for large models.")
    fsdp: Fsdp = Field(default_factory=Fsdp, description="How FSDP (dpShard*cp > 1) holds parameters: "
                       "resharding after forward (ZeRO-3 or ZeRO-2 behaviour) and CPU offload.")
    loss_chunks: int = Field(1, ge=1, le=1024, description="Apply the output projection and the loss to this "
                             "many slices of the sequence, recomputing each slice's logits in the backward: "
                             "the batch x seq x vocab logits and their fp32 copies exist one slice at a time "
                             "(less memory, one more output-layer forward). 1: the plain loss.")
    init_from: Annotated[str | None, _hf_dir("training.initFrom", "/models/llama-hf")] = Field(
        None, json_schema_extra={"pattern": _ABSOLUTE_NORMAL}, description=(
            "Initial weights instead of the seed's: the absolute path inside the pod of a Hugging Face "
            "directory (config.json, *.safetensors) of this model, e.g. one written by python -m "
            "tetrad_trainer.export, mounted through template.volumes. The same as model.hfDir, which also "
            "gives the CLI the model's dims; set one of them, or both to the same path. A resumed "
            "checkpoint's weights win; a directory of another model stops every rank with exit 78."))


class DataSource(StrEnum):
    SYNTHETIC = "synthetic"
    TEXT = "text"
    TOKENS = "tokens"
    JSONL = "jsonl"


class Data(CamelModel):
    source: DataSource = Field(DataSource.SYNTHETIC, strict=False, description="synthetic (deterministic "
                               "from the seed), text (a local text file), tokens (a pre-tokenized, "
                               "memory-mapped token file) or jsonl (fine-tuning data: prompt/completion or "
                               "chat lines, only the answers learned; docs/data.md).")
    path: str | None = Field(None, min_length=1,
                             description="Path inside the pod of the text, token or JSONL file.")
    tokenizer: str = Field("byte", description="'byte' for the byte-level tokenizer (text only), or the path "
                           "inside the pod of a Hugging Face tokenizer: its directory (tokenizer.json, "
                           "tokenizer_config.json with the special tokens and chat template, "
                           "chat_template.jinja) or its tokenizer.json. jsonl needs the directory's special "
                           "tokens (eos_token) and, for chat lines, its chat template.")
    token_dtype: Literal["uint16", "uint32"] = Field("uint16", description="Element type of a token file, "
                                                     "whose ids lie one after another, little-endian, "
                                                     "without a header: uint16 holds ids below 65536, uint32 "
                                                     "any. A file that looks like the other type, or holds "
                                                     "an id outside the model's vocab, stops every rank at "
                                                     "start-up with exit 78 (docs/data.md).")
    packing: bool = Field(False, description="jsonl: false puts each sample alone in a row of seqLen+1 "
                          "tokens, padded; true fills rows with whole samples in an order drawn from the "
                          "seed (less padding; a sample attends to the earlier samples of its row).")
    truncate: bool = Field(False, description="jsonl: a sample longer than seqLen+1 tokens stops every rank "
                           "with exit 78 naming its line (false), or keeps its first seqLen+1 tokens (true; "
                           "rank 0 logs how many were cut, and leaves out those with nothing left to learn).")


class Checkpoint(CamelModel):
    enabled: bool = Field(False, description="Save DCP checkpoints.")
    path: Annotated[str, AfterValidator(_checkpoint_path)] = Field(
        "/checkpoints",
        description=f"Absolute directory of the checkpoints inside the pod; not /, not under {CONFIG_DIR}.")
    volume: dict[str, Any] | None = Field(
        None, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}, description=(
            "A Kubernetes volume source mounted at path, e.g. {persistentVolumeClaim: {claimName: ckpt}}. "
            "Without it, mount a volume at path through the pod template."))
    interval: int = Field(100, ge=1, description="Save every this many steps.")
    keep_last: int = Field(3, ge=1, description="Committed checkpoints to keep; older ones are removed only "
                           "after a newer one is committed.")
    resume: bool = Field(True, description="Resume from the latest good checkpoint when one exists.")
    allow_foreign: bool = Field(False, description="Resume a checkpoint in path that a job of another name "
                                "wrote (each checkpoint's manifest names its job), e.g. after renaming the "
                                "job. false: such a checkpoint stops every rank with exit 78 naming both "
                                "jobs. Either way retention deletes only this job's own checkpoints.")
    async_save: bool = Field(False, alias="async", description="Overlap saving with training.")


class Metrics(CamelModel):
    port: int = Field(9400, ge=1024, le=65535,
                      description="Port of every rank's Prometheus endpoint (rank r on port + local rank).")
    log_interval: int = Field(1, ge=1,
                              description="Log a JSON line and update metrics every this many steps.")
    peak_tflops: float | None = Field(None, gt=0, description="Peak TFLOPS per device for MFU; defaults to "
                                      "the GPU's datasheet bf16 peak, or a measured matmul peak on CPU.")
    slow_rank_lag: float = Field(0.2, ge=0, le=1, description=(
        "Name a rank slow (status.stragglers, condition SlowRank) when its own time per step (its compute "
        "and its wait for data, not its waits for peers) exceeds its peers' median by this fraction of the "
        "step; 0 turns the condition off (the figures are still exported)."))
    exclude_slow_nodes_after_seconds: int | None = Field(None, ge=1, description=(
        "Exclude a node whose rank stays slow (at or above slowRankLag) this long at the gang's next "
        "restart, like a node that failed the preflight gate: named in status.failedNodes, avoided while "
        "spec.preflight.excludeFailedNodes allows it, within spec.preflight.maxExcludedNodes. A slow node "
        "does not itself restart the gang. Unset: slow nodes are named, never excluded."))


class Resources(CamelModel):
    cpu: str | None = Field(None, description="CPU request and limit per pod, e.g. '8'.")
    memory: str | None = Field(None, description="Memory request and limit per pod, e.g. '64Gi'.")
    gpu: int = Field(0, ge=0, description="nvidia.com/gpu per pod. 0 runs on CPU with gloo; otherwise it "
                     "must equal nprocPerNode.")
    gpu_memory_gib: float = Field(80.0, gt=0, alias="gpuMemoryGiB", description="Memory of one GPU in GiB; "
                                  "the planner's auto degrees must fit in it.")
    gpu_type: str | None = Field(None,
                                 description="GPU model for the MFU peak-FLOPS table, e.g. H100, H200, A100.")


_OBJ: Final[dict[str, Any]] = {"x-kubernetes-preserve-unknown-fields": True}


class PodTemplate(CamelModel):
    env: list[dict[str, Any]] = Field(default_factory=list, json_schema_extra={"items": _OBJ},
                                      description="Extra container env vars (Kubernetes EnvVar objects).")
    volumes: list[dict[str, Any]] = Field(default_factory=list, json_schema_extra={"items": _OBJ},
                                          description="Extra pod volumes (Kubernetes Volume objects).")
    volume_mounts: list[dict[str, Any]] = Field(default_factory=list, json_schema_extra={"items": _OBJ},
                                                description="Extra container volume mounts (Kubernetes "
                                                "VolumeMount objects).")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels every pod requires.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, json_schema_extra={"items": _OBJ},
                                              description="Pod tolerations (Kubernetes Toleration objects).")
    affinity: dict[str, Any] | None = Field(None, json_schema_extra=_OBJ,
                                            description="Pod affinity (a Kubernetes Affinity object).")
    priority_class_name: str | None = Field(None, description="PriorityClass of the pods.")
    service_account_name: str | None = Field(None, description="ServiceAccount the pods run as.")
    labels: dict[str, str] = Field(default_factory=dict, description="Extra pod labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra pod annotations.")


class Scheduler(StrEnum):
    BUILTIN = "builtin"
    VOLCANO = "volcano"
    COSCHEDULING = "coscheduling"
    KUEUE = "kueue"
    WORKLOAD = "workload"


class TopologyMode(StrEnum):
    REQUIRED = "Required"
    PREFERRED = "Preferred"


# A Kubernetes label key: an optional DNS-subdomain prefix and '/', then a name of at most 63 characters.
_LABEL_KEY: Final = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                               r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


def _label_key(key: str | None) -> str | None:
    if key is not None and (len(key) > 316 or not _LABEL_KEY.fullmatch(key)):
        raise ValueError("must be a node label key such as tetrad.dev/rack or topology.kubernetes.io/zone")
    return key


class Gang(CamelModel):
    scheduler: Scheduler = Field(Scheduler.BUILTIN, strict=False, description="Gang scheduler: builtin "
                                 "(Tetrad's scheduling gates), volcano, coscheduling (scheduler-plugins), "
                                 "kueue, or workload (Kubernetes' Workload and PodGroup API, "
                                 "scheduling.k8s.io/v1alpha2, alpha in 1.36 behind the GangScheduling gate).")
    queue: str | None = Field(None, description="Queue name: the Volcano queue or the Kueue LocalQueue.")
    timeout_seconds: int = Field(300, ge=1, description="If some pods are still unscheduled this long after "
                                 "release, the gang is re-gated and retried with backoff.")
    scheduler_name: str | None = Field(None, description="Pod schedulerName; defaults to 'volcano' for "
                                       "volcano, 'scheduler-plugins-scheduler' for coscheduling, the default "
                                       "scheduler otherwise.")
    topology_key: Annotated[str | None, AfterValidator(_label_key)] = Field(
        None, json_schema_extra={"pattern": f"^{_LABEL_KEY.pattern}$", "maxLength": 316}, description=(
            "Node label naming a rack or NVLink domain, e.g. tetrad.dev/rack: the pods of each pipeline "
            "stage (the whole gang when pp=1) go to nodes sharing one value of it (a pod affinity per stage; "
            "the workload PodGroup's topology constraint, Kueue's podset topology annotations and Volcano's "
            "networkTopology where the scheduler has one)."))
    topology_mode: TopologyMode = Field(TopologyMode.REQUIRED, strict=False, description="Required: a stage "
                                        "that fits in no single domain waits; Preferred: the scheduler tries "
                                        "to keep each stage in one domain but may spread it.")


class CleanPodPolicy(StrEnum):
    ALL = "All"
    RUNNING = "Running"
    NONE = "None"


# A process exit code the restart policy can list: 0 is success, never a failure to judge.
ExitCode = Annotated[int, Field(ge=1, le=255)]
EXIT_CODES_MAX: Final = 255


class RunPolicy(CamelModel):
    max_restarts: int = Field(3, ge=0, description="Whole-gang restarts after failures allowed before the "
                              "job fails. Disruptions (preemption, eviction, a lost node) count against "
                              "maxDisruptions instead.")
    max_disruptions: int = Field(20, ge=0, description="Whole-gang restarts after disruptions (preemption, "
                                 "eviction, a lost node, a stall) allowed before the job fails with "
                                 "DisruptionBudgetExceeded; 0: the first disruption fails the job.")
    backoff_seconds: int = Field(10, ge=0,
                                 description="Delay before the first restart; doubles with each restart.")
    backoff_max_seconds: int = Field(300, ge=0,
                                     description="Cap of the restart delay; at least backoffSeconds.")
    retryable_exit_codes: list[ExitCode] = Field(
        default_factory=list, max_length=EXIT_CODES_MAX, description=(
            "Exit codes (1-255) that trigger a restart. Empty means every failure not listed as permanent. "
            "Evictions, lost nodes, preemption (75) and a node failing the preflight gate (69) are always "
            "retryable. Not in permanentExitCodes too."))
    permanent_exit_codes: list[ExitCode] = Field(
        default_factory=lambda: [EXIT_OOM, EXIT_CONFIG_ERROR], max_length=EXIT_CODES_MAX, description=(
            "Exit codes (1-255) that fail the job at once, without a restart. Default: 77 (the trainer ran "
            "out of device memory) and 78 (a config the trainer cannot run). Not 69 or 75, which are always "
            "retried as disruptions."))
    active_deadline_seconds: int | None = Field(None, ge=1,
                                                description="Fail the job when it has been active this long.")
    ttl_seconds_after_finished: int | None = Field(None, ge=0, description="Delete the job this long after "
                                                   "it succeeded or failed.")
    clean_pod_policy: CleanPodPolicy = Field(CleanPodPolicy.RUNNING, strict=False, description="Pods deleted "
                                             "when the job ends: All, Running (only those still running) "
                                             "or None.")
    stall_timeout_seconds: int | None = Field(None, ge=0, description="Restart the gang (a disruption, "
                                              "reason Stalled) when rank 0 completes no step for this long "
                                              "while the job is Running. Default: 10 x the measured step "
                                              "time, at least 300 s and at least collectiveTimeoutSeconds + "
                                              "60 s; 0 disables it.")
    collective_timeout_seconds: int = Field(COLLECTIVE_TIMEOUT_SECONDS, ge=5, description=(
        "A collective (all-reduce, all-gather, ...) that waits this long for its peers fails: every waiting "
        "rank logs the collective and the peers that did not answer, and exits 79 (reason CollectiveTimeout, "
        "retryable). Keep it below stallTimeoutSeconds, or the operator restarts a hung gang as Stalled "
        "first, without naming the peers."))
    suspend: bool = Field(False, description="Suspend the job: its pods are deleted and the job kept; set "
                          "false to resume. Kueue admits jobs this way.")
    termination_grace_period_seconds: int = Field(120, ge=0, description="Time a pod has after SIGTERM to "
                                                  "save a checkpoint and exit.")


class Rendezvous(CamelModel):
    port: int = Field(29500, ge=1024, le=65534,
                      description="Port of rank 0's c10d rendezvous and process-group store; the next port "
                      "is pod 0's coordinator of restarts in place.")
    timeout_seconds: int = Field(900, ge=1, description="How long workers wait for all nodes to join, "
                                 "including while rank 0's DNS name does not resolve yet; a worker whose "
                                 "wait for the name runs out exits 69 naming itself (a disruption for "
                                 "the operator).")


class Elastic(CamelModel):
    min_nodes: int = Field(ge=1, le=MAX_NODES, description="The fewest pods the job may run on. Below "
                           "spec.nodes the data-parallel degrees shrink (tp, cp and pp are kept) and the "
                           "global batch stays the same, with more gradient accumulation.")
    shrink_after_seconds: int = Field(120, ge=0, description="How long a gang waits for room for all of its "
                                      "pods before it restarts on as many as fit (at least minNodes).")
    grow_after_seconds: int = Field(60, ge=0, description="How long room for more pods must last before a "
                                    "shrunken gang grows back: after a checkpoint it asks for, with Tetrad's "
                                    "trainer; at once, with a script (which resumes from its own).")


class Preflight(CamelModel):
    enabled: bool = Field(True, description="Check every node before training: its devices (CUDA: at least "
                          "nprocPerNode) or the CPUs resources.cpu requests, that pod 0's rendezvous name "
                          "resolves, and a short all-reduce across the whole gang within timeoutSeconds, "
                          "measuring each node's bus bandwidth. A node that fails exits 69 naming itself and "
                          "the reason.")
    timeout_seconds: int = Field(120, ge=1, le=3600, description="Bound of the preflight all-reduce (and of "
                                 "each node check); a gang that does not complete it in time fails the gate.")
    all_reduce_mi_b: int = Field(64, ge=1, le=4096, alias="allReduceMiB", description="Size of the preflight "
                                 "all-reduce buffer in MiB (per rank).")
    slow_node_fraction: float = Field(0.5, ge=0, le=1, description="A node whose measured bus bandwidth is "
                                      "below this fraction of the gang's median is reported slow (condition "
                                      "SlowNodes, an Event); 0 disables the report.")
    exclude_failed_nodes: bool = Field(True, description="Restart the gang away from a node that failed the "
                                       "preflight gate: the new pods get a required node anti-affinity "
                                       "listing the excluded nodes (status.failedNodes), at most "
                                       "maxExcludedNodes of them.")
    max_excluded_nodes: int = Field(3, ge=0, description="How many nodes the job may exclude; once spent, a "
                                    "failing node is named in status but the gang restarts without "
                                    "avoiding it.")


def _working_dir(path: str | None) -> str | None:
    if path is not None and (not re.search(_ABSOLUTE_NORMAL, path) or re.search(_DOT_COMPONENT, path)):
        raise ValueError("script.workingDir must be an absolute, normalized directory in the image, "
                         "e.g. /app")
    return path


def _entry(items: list[str] | None) -> list[str] | None:
    if items is not None and (not items or any(not a for a in items)):
        raise ValueError("script.command must be a non-empty list of non-empty strings, e.g. [/app/train.sh]")
    return items


class Script(CamelModel):
    """Your own training code under Tetrad's launcher (docs/bring-your-own.md): exactly one entry point."""

    path: str | None = Field(None, min_length=1, description="A Python file in the image that every worker "
                             "runs as __main__ (torchrun's training script), e.g. /app/train.py; relative to "
                             "workingDir when relative.")
    module: Annotated[str | None, AfterValidator(_python_module)] = Field(
        None, json_schema_extra={"pattern": PYTHON_MODULE},
        description="A Python module that every worker runs as `python -m MODULE`, e.g. mypkg.train.")
    command: Annotated[list[str] | None, AfterValidator(_entry)] = Field(
        None, json_schema_extra={"minItems": 1},
        description="An executable in the image and its first arguments, run by every worker without Python "
        "(torchrun --no-python), e.g. [/app/train.sh].")
    args: list[str] = Field(default_factory=list,
                            description="Arguments after the entry point, the same for every worker.")
    working_dir: Annotated[str | None, AfterValidator(_working_dir)] = Field(
        None, json_schema_extra={"pattern": _ABSOLUTE_NORMAL},
        description="The workers' working directory in the image; default: the image's.")

    def describe(self) -> str:
        """The entry point and its arguments, as a shell would show them."""
        what = [self.path] if self.path else ["-m", self.module] if self.module else list(self.command or [])
        return " ".join(shlex.quote(str(a)) for a in [*what, *self.args])

    @model_validator(mode="after")
    def _one_entry_point(self) -> Script:
        given = [name for name in ("path", "module", "command") if getattr(self, name) is not None]
        if len(given) != 1:
            named = f"{' and '.join(given)} are both given" if given else "none is given"
            raise ValueError(f"give exactly one entry point of path, module or command: {named}")
        return self


class ParallelTrainingJobSpec(CamelModel):
    nodes: int = Field(1, ge=1, le=MAX_NODES, description="Number of pods (one torchrun agent per pod).")
    nproc_per_node: int = Field(1, ge=1, le=64,
                                description="Processes per pod; one per GPU when resources.gpu > 0.")
    parallelism: Parallelism = Field(default_factory=Parallelism, description="The 4D layout. The product of "
                                     "the degrees must equal nodes * nprocPerNode.")
    script: Script | None = Field(None, description="Your own training code instead of Tetrad's trainer: a "
                                  "Python file, module or command that every worker runs under torchrun, "
                                  "with the job's gang, rendezvous, restarts and exit-code policy "
                                  "(docs/bring-your-own.md). Not with model, training or data, which "
                                  "configure Tetrad's trainer.")
    model: ModelSpec = Field(default_factory=ModelSpec, description="The model Tetrad's trainer builds: a "
                             "preset or a family with explicit dims, a Hugging Face directory to fine-tune "
                             "(hfDir), or your own model definition (module).")
    training: Training = Field(default_factory=Training,
                               description="Optimizer, schedule, batch and numerics.")
    data: Data = Field(default_factory=Data, description="Where training tokens come from.")
    checkpoint: Checkpoint = Field(default_factory=Checkpoint, description="DCP checkpointing and resume.")
    metrics: Metrics = Field(default_factory=Metrics, description="Prometheus endpoint and logging.")
    image: Annotated[str, AfterValidator(_image)] = Field("tetrad/trainer:0.1.0", min_length=1,
                                                          description="Trainer container image.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Image pull policy of the trainer container.")
    resources: Resources = Field(default_factory=Resources,
                                 description="Per-pod resources and the GPU's memory for planning.")
    template: PodTemplate = Field(default_factory=PodTemplate,
                                  description="A partial pod template merged into every pod.")
    gang: Gang = Field(default_factory=Gang, description="Gang scheduling: all pods run or none do.")
    run_policy: RunPolicy = Field(default_factory=RunPolicy,
                                  description="Restarts, deadlines, cleanup and suspension.")
    rendezvous: Rendezvous = Field(default_factory=Rendezvous, description="torchrun rendezvous settings.")
    preflight: Preflight = Field(default_factory=Preflight, description="The preflight gate every pod passes "
                                 "before training, and what the operator does with a node that fails it.")
    elastic: Elastic | None = Field(None, description="Run on fewer pods (down to minNodes) when the gang "
                                    "cannot get all of spec.nodes, and grow back when room returns. Needs "
                                    "gang.scheduler builtin, whose admission knows the room.")


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: Annotated[str, AfterValidator(_job_name)]
    namespace: Annotated[str, AfterValidator(_namespace)] = "default"
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class Phase(StrEnum):
    PENDING = "Pending"
    GANG_WAITING = "GangWaiting"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"


class Condition(CamelModel):
    type: str = Field(description="Condition type, e.g. GangReleased, Running, Succeeded, Failed, "
                      "Suspended, Restarting.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field("", description="CamelCase reason of the last transition.")
    message: str = Field("", description="Human-readable detail.")
    last_transition_time: str | None = Field(None, description="When the status last changed (RFC 3339).")


class TrainingStatus(CamelModel):
    step: int | None = Field(None, description="Last step reported by rank 0.")
    loss: float | None = Field(None, description="Last training loss.")
    tokens_per_second: float | None = Field(None, description="Global training throughput.")
    mfu: float | None = Field(None, description="Model FLOPs utilization, 0..1.")
    peak_memory_bytes: int | None = Field(None, description="Peak device memory of rank 0.")
    step_time_seconds: float | None = Field(None,
                                            description="Mean step time over rank 0's last log interval.")
    last_step_time: str | None = Field(None, description="When rank 0 last completed a step (RFC 3339, the "
                                       "pod's clock): the heartbeat of stall detection.")
    startup_seconds: float | None = Field(None, description="Rank 0's start-up in its last incarnation that "
                                          "completed a step: process start to the end of the first step.")
    updated: str | None = Field(None, description="When these figures were read (RFC 3339).")


class CheckpointRequestStatus(CamelModel):
    token: str = Field(description="The tetrad.dev/checkpoint-now token.")
    step: int | None = Field(None, description="The step whose checkpoint served it.")
    time: str | None = Field(None,
                             description="When that checkpoint was committed (RFC 3339, the pod's clock).")


class CheckpointStatus(CamelModel):
    step: int | None = Field(None, description="Step of the last checkpoint rank 0 committed; kept across "
                             "restarts until a later incarnation commits its own.")
    time: str | None = Field(None,
                             description="When that checkpoint was committed (RFC 3339, the pod's clock).")
    path: str | None = Field(None,
                             description="Its directory inside the pod: spec.checkpoint.path/step-NNNNNNNN.")
    resumed_from: int | None = Field(None, description="Step the incarnation of restart resumedAtRestart "
                                     "resumed from; 0: it started fresh.")
    resumed_at_restart: int | None = Field(None, description="The restart (status.restarts) whose "
                                           "incarnation resumed from resumedFrom.")
    requested: str | None = Field(None, description="The last tetrad.dev/checkpoint-now token the operator "
                                  "passed to rank 0.")
    request_committed: CheckpointRequestStatus | None = Field(None, description="The last checkpoint-now "
                                                              "request rank 0 served, once its checkpoint "
                                                              "committed.")


class FailedNode(CamelModel):
    node: str = Field(description="The Kubernetes node (or, outside Kubernetes, the host) that failed.")
    reason: str = Field(description="Which check failed and why, as the trainer said it; or how long its "
                        "rank stayed slow.")
    restart: int = Field(description="The restart (incarnation) in which it failed.")
    excluded: bool = Field(description="Whether later incarnations avoid the node (a required node "
                           "anti-affinity).")


class PreflightNode(CamelModel):
    node: str = Field(description="The node.")
    node_rank: int = Field(description="Its rank in the gang.")
    bus_bandwidth_g_bps: float = Field(alias="busBandwidthGBps", description="Bus bandwidth its ranks "
                                       "measured in the preflight all-reduce, in GB/s (10^9 bytes).")


class PreflightStatus(CamelModel):
    restart: int | None = Field(None, description="The incarnation these figures are from.")
    bus_bandwidth_g_bps: float | None = Field(None, alias="busBandwidthGBps", description="The median of the "
                                              "nodes' bus bandwidth, GB/s.")
    nodes: list[PreflightNode] = Field(default_factory=list, description="Each node's figure, read from rank "
                                       "0; nodes below spec.preflight.slowNodeFraction of the median make "
                                       "the condition SlowNodes.")
    updated: str | None = Field(None, description="When these figures were read (RFC 3339).")


class StragglerRank(CamelModel):
    rank: int = Field(description="The global rank.")
    node: str = Field(description="The Kubernetes node (or host) it runs on.")
    lag: float = Field(description="Its own time per step over the median rank's, as a fraction of the step: "
                       "the share of every step the gang waits for it.")
    own_seconds: float | None = Field(None, description="Its own time per step: compute (the CPU time of its "
                                      "main thread on CPUs) and the wait for its next batch.")


class SlowRankNode(CamelModel):
    node: str = Field(description="The node.")
    since: str = Field(description="When a rank on it was first named slow, without a break since "
                       "(RFC 3339).")


class StragglersStatus(CamelModel):
    restart: int | None = Field(None, description="The incarnation these figures are from.")
    step: int | None = Field(None, description="The step at which rank 0 gathered them.")
    median_own_seconds: float | None = Field(None, description="The median rank's own time per step.")
    ranks: list[StragglerRank] = Field(default_factory=list, description="The slowest ranks, slowest first.")
    updated: str | None = Field(None, description="When these figures were read (RFC 3339).")


class TrainerAccount(CamelModel):
    step: int | None = Field(None, description="The step rank 0 last logged.")
    resumed_from: int | None = Field(None, description="The step rank 0's process resumed from (0: a fresh "
                                     "start).")
    startup_seconds: float | None = Field(None, description="Rank 0's process start to the end of its "
                                          "first step (the preflight gate included).")
    preflight_seconds: float | None = Field(None, description="The preflight gate's wall time, on its "
                                            "slowest node.")
    train_seconds: float | None = Field(None, description="Rank 0's time from the end of its first step to "
                                        "its last log, checkpoint stalls excluded.")
    checkpoint_stall_seconds: float | None = Field(None, description="Rank 0's time blocked on checkpoint "
                                                   "saves since its first step.")


class TrainerTimeStatus(TrainerAccount):
    restart: int | None = Field(None, description="The incarnation these figures are from.")
    round: int | None = Field(None, description="The round of restarts in place of that incarnation these "
                              "figures are from (0: the first).")
    round_cause: str | None = Field(None, description="The failure that began that round.")
    previous_round: TrainerAccount | None = Field(None, description="Rank 0's last account of the round "
                                                  "before it, as the scraper last read it.")
    updated: str | None = Field(None, description="When these figures were read (RFC 3339).")

    def account(self) -> TrainerAccount:
        """The account alone, without what says whose it is."""
        return TrainerAccount.model_validate(self.model_dump(include=set(TrainerAccount.model_fields)))


class InPlaceAsk(CamelModel):
    restart: int = Field(description="The incarnation asked.")
    round: int = Field(description="Its round the ask would end (the next one is round + 1).")
    time: str = Field(description="When the operator asked (RFC 3339).")
    cause: str = Field(description="Why: the stall the operator saw, or the restart a user asked for.")
    token: str | None = Field(None, description="The tetrad.dev/restart-in-place token asked for (the "
                              "workers save first); none for a stall.")
    accepted: bool | None = Field(None, description="Pod 0's coordinator's answer (false: it refused or did "
                                  "not answer; a stalled gang is then recreated).")


class ElasticStatus(CamelModel):
    nodes: int = Field(description="The pods the current incarnation runs on (spec.nodes is the size asked "
                       "for).")
    resizes: int = Field(0, description="Restarts that changed the gang's size; like disruptions, they spend "
                         "no maxRestarts.")
    room: int | None = Field(None, description="How many of the job's pods fit in the cluster, as the gang "
                             "admission last counted them (while the gang waits or runs below spec.nodes).")
    room_since: str | None = Field(None, description="Since when room for a larger gang has lasted (RFC "
                                   "3339).")
    grow_request: str | None = Field(None, description="The checkpoint-now token the operator sent rank 0 "
                                     "before growing the gang.")


class GoodputSeconds(CamelModel):
    productive: float = Field(0.0, description="Steps that counted.")
    queued: float = Field(0.0, description="Pending and GangWaiting: the queue or the scheduler held the "
                          "gang (after a restart too).")
    startup: float = Field(0.0, description="From all pods running to the end of the first step (image, "
                           "rendezvous, model build, checkpoint load, compile), the preflight aside.")
    preflight: float = Field(0.0, description="The preflight gate.")
    restarts: float = Field(0.0, description="From a failed incarnation's last logged step to its "
                            "replacement's pods (detection, teardown and backoff), or, restarting in place, "
                            "to the next round's workers.")
    recomputed: float = Field(0.0, description="Steps after the last checkpoint of an incarnation (or a "
                              "round of it) that ended early, which the next one trained again.")
    checkpoint: float = Field(0.0, description="The training loop blocked on checkpoint saves.")
    suspended: float = Field(0.0, description="Suspended.")


class GoodputStatus(CamelModel):
    fraction: float | None = Field(None, description="The share of the wall time spent on steps that "
                                   "counted, 0..1, as of asOf.")
    wall_seconds: float = Field(0.0, description="From the job's creation to asOf (to its end once it "
                                "ended).")
    seconds: GoodputSeconds = Field(default_factory=GoodputSeconds, description="Where the wall time went, "
                                    "as of asOf; the kinds add up to wallSeconds.")
    as_of: str | None = Field(None, description="The time these figures describe (RFC 3339); refreshed with "
                              "every phase change and at most once a minute between them.")
    since: str | None = Field(None, description="The ledger: when the current phase began.")
    settled: GoodputSeconds = Field(default_factory=GoodputSeconds, description="The ledger: the time "
                                    "before `since`, except the current incarnation's time running.")
    restart: int = Field(0, description="The ledger: the current incarnation.")
    round: int = Field(0, description="The ledger: the current round of restarts in place of that "
                       "incarnation.")
    running_seconds: float = Field(0.0, description="The ledger: the current incarnation's time running "
                                   "before `since`.")


class ParallelTrainingJobStatus(CamelModel):
    phase: Phase | None = Field(None, strict=False, description="Pending, GangWaiting, Running, Restarting, "
                                "Succeeded, Failed or Suspended.")
    conditions: list[Condition] = Field(default_factory=list, description="Detailed state with reasons.")
    restarts: int = Field(0, description="Whole-gang restarts so far, disruptions included.")
    disruptions: int = Field(0, description="Restarts the cluster caused, not the job: preemption (exit 75), "
                             "eviction, a lost node or a deleted pod. They do not count against maxRestarts.")
    restarts_in_place: int = Field(0, description="Restarts of the whole gang in its own pods (a worker "
                                   "failed, the pods did not): new processes, a new rendezvous, the last "
                                   "checkpoint. They count against maxRestarts, except disruptionsInPlace "
                                   "and askedInPlace.")
    disruptions_in_place: int = Field(0, description="Of restartsInPlace, those the operator asked for "
                                      "because the gang stalled: disruptions, counted against maxDisruptions "
                                      "and not maxRestarts.")
    asked_in_place: int = Field(0, description="Of restartsInPlace, those a user asked for with the "
                                "tetrad.dev/restart-in-place annotation: the workers saved first; they "
                                "spend no budget.")
    restart_requested: str | None = Field(None, description="The last tetrad.dev/restart-in-place token the "
                                          "operator acted on.")
    round: int = Field(0, description="The current incarnation's round of restarts in place (0: none yet).")
    in_place_ask: InPlaceAsk | None = Field(None, description="The operator's last ask of pod 0's "
                                            "coordinator to restart the gang in place: after a stall, or "
                                            "a user's tetrad.dev/restart-in-place token.")
    elastic: ElasticStatus | None = Field(None, description="An elastic job's current size (spec.elastic).")
    world_size: int | None = Field(None, description="Number of training processes.")
    mesh: str | None = Field(None, description="The resolved layout, e.g. pp2.dpr1.dps2.cp1.tp2.")
    start_time: str | None = Field(None, description="When the job became active (RFC 3339); reset when a "
                                   "suspended job resumes, and activeDeadlineSeconds counts from it.")
    completion_time: str | None = Field(None, description="When the job succeeded or failed (RFC 3339).")
    observed_generation: int | None = Field(None, description="The spec generation this status describes.")
    message: str | None = Field(None, description="Why the job is in its phase.")
    training: TrainingStatus | None = Field(None,
                                            description="Live figures read from rank 0's metrics endpoint.")
    checkpoint: CheckpointStatus | None = Field(None, description="The last committed checkpoint and the "
                                                "step the current incarnation resumed from, read from rank "
                                                "0's metrics endpoint.")
    preflight: PreflightStatus | None = Field(None, description="The preflight gate's measured all-reduce "
                                              "bus bandwidth per node, read from rank 0's metrics endpoint.")
    stragglers: StragglersStatus | None = Field(None, description="The slowest ranks of the current "
                                                "incarnation, read from rank 0's metrics endpoint.")
    trainer_time: TrainerTimeStatus | None = Field(None, description="Rank 0's account of the current "
                                                   "incarnation's time, read from its metrics endpoint.")
    goodput: GoodputStatus | None = Field(None, description="How much of the job's wall time trained, and "
                                          "where the rest went.")
    failed_nodes: list[FailedNode] = Field(default_factory=list, description="Nodes that failed the "
                                           "preflight gate or stayed slow (spec.metrics."
                                           "excludeSlowNodesAfterSeconds), with the reason; the excluded "
                                           "ones count against spec.preflight.maxExcludedNodes.")
    slow_rank_nodes: list[SlowRankNode] = Field(default_factory=list, description="The nodes of the ranks "
                                                "condition SlowRank names now, and since when each has "
                                                "been named.")


class ParallelTrainingJob(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid")
    api_version: Literal["tetrad.dev/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["ParallelTrainingJob"] = KIND
    metadata: ObjectMeta
    spec: ParallelTrainingJobSpec = Field(default_factory=ParallelTrainingJobSpec)
    status: ParallelTrainingJobStatus | None = None
