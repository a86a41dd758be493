"""The layout rules, written once: Python validation, the trainer's check of a resolved config and
the CRD's CEL rules (tetrad.api.crd) all take them from here.

Invariants:
- a rule lives in one function or constant here; the CEL generator builds its expressions from
  the same constants (tests/api/test_crd.py checks with generated specs that CEL and Python agree);
- the checks append field-named problems (field, values, fix) and never raise;
- this module imports only the API model: the planner and the trainer sit above it.
"""

from __future__ import annotations

from typing import Final

from tetrad.api.accelerators import find_accelerator
from tetrad.api.contract import EXIT_ALWAYS_RETRIED
from tetrad.api.problems import Problem
from tetrad.api.resolved import Layout, ModelConfig, ResolvedConfig
from tetrad.api.spec import (
    Data,
    DataSource,
    Float8Recipe,
    Offload,
    ParallelTrainingJobSpec,
    PPSchedule,
    Precision,
    Resources,
    RunPolicy,
    Scheduler,
    Training,
)

# Schedules that hold several pipeline stages per rank.
MULTI_STAGE: Final = (PPSchedule.INTERLEAVED_1F1B, PPSchedule.ZERO_BUBBLE)
# Stages per rank of a multi-stage schedule when ppStagesPerRank is not set.
DEFAULT_MULTI_STAGES_PER_RANK: Final = 2
# ZeroBubble runs its V-shaped schedule with exactly this many stages per rank.
ZERO_BUBBLE_STAGES_PER_RANK: Final = 2
# The pipeline split counts the token embedding and the output projection as one layer each
# (tetrad_trainer.parallelize.stage_layers, tetrad.plan.estimate.stage_params), so a model of
# L blocks splits into at most L + 2 stages that each hold something.
NON_BLOCK_STAGE_UNITS: Final = 2


# What runs, said once: a script job (spec.script) gives none of the trainer's sections and settings, and
# a model definition of one's own (spec.model.module) gives its dims, not a preset.
TRAINER_ONLY: Final = ("model", "training", "data")
TRAINER_PIPELINE: Final = ("ppMicrobatches", "ppStagesPerRank")
# kvHeads defaults to heads, ffnDim to 4 x dim
PLUGIN_DIMS: Final = ("dim", "layers", "heads", "vocab", "seqLen")


def trainer_only_message(name: str) -> str:
    return (f"spec.script runs your own training code; spec.{name} configures Tetrad's trainer: remove it "
            "and pass your settings in spec.script.args (or use spec.model.module to train your model in "
            "Tetrad's trainer)")


SCRIPT_CHECKPOINT_MESSAGE: Final = ("spec.script saves its own checkpoints; checkpoint.enabled turns on "
                                    "Tetrad's trainer's: remove it (checkpoint.path and .volume are still "
                                    "mounted, and passed as $TETRAD_CHECKPOINT_DIR)")


def trainer_pipeline_message(name: str) -> str:
    return (f"{name} configures Tetrad's trainer's pipeline schedule; a script job (spec.script) schedules"
            " its own: remove it")


PLUGIN_PRESET_MESSAGE: Final = ("a model definition of your own (module) takes its dims from spec.model, not "
                                "a preset; remove preset")


def plugin_dims_message(missing: list[str] | tuple[str, ...]) -> str:
    return (f"module needs its dims in spec.model: {', '.join(missing)} missing (kvHeads defaults to heads,"
            " ffnDim to 4 x dim)")


# Data: the sources read from a file, and what a JSONL source needs of its tokenizer.
FILE_SOURCES: Final = (DataSource.TEXT, DataSource.TOKENS, DataSource.JSONL)
BYTE_TOKENIZER: Final = "byte"
JSONL_ONLY: Final = ("packing", "truncate")
# The path message takes the source's name ({} in Python, %s in CEL's format()).
DATA_PATH_MESSAGE: Final = "data.source={} needs data.path; set the path of the file inside the pod"
JSONL_TOKENIZER_MESSAGE: Final = (
    "data.source=jsonl needs a Hugging Face tokenizer, not the byte tokenizer: its special tokens end each "
    "completion and its chat template renders chat lines; set data.tokenizer to the tokenizer's directory "
    "inside the pod (tokenizer.json and tokenizer_config.json), e.g. /data/tokenizer")


def check_data(data: Data, problems: list[Problem]) -> None:
    """A file source needs its path; jsonl needs a Hugging Face tokenizer; packing and truncate act on jsonl
    alone."""
    if data.source in FILE_SOURCES and not data.path:
        problems.append(Problem("spec.data.path", DATA_PATH_MESSAGE.format(data.source.value)))
    if data.source == DataSource.JSONL and data.tokenizer == BYTE_TOKENIZER:
        problems.append(Problem("spec.data.tokenizer", JSONL_TOKENIZER_MESSAGE))
    if data.source != DataSource.JSONL:
        problems += [Problem(f"spec.data.{name}", f"{name} acts on data.source=jsonl alone, this job reads "
                             f"{data.source.value} data: remove it", "warning")
                     for name in JSONL_ONLY if name in data.model_fields_set]


# The byte tokenizer's ids are the byte values: a model it feeds needs a vocab of at least 256.
BYTE_VOCAB: Final = 256
# No apostrophe: CEL's messageExpression quotes the message with them.
BYTE_VOCAB_MESSAGE: Final = (f"vocab={{}} is below the {BYTE_VOCAB} ids of the byte tokenizer "
                             "(data.source=text with data.tokenizer: byte, the default); set vocab to at "
                             f"least {BYTE_VOCAB}, or name a Hugging Face tokenizer in data.tokenizer")


def check_data_vocab(data: Data, vocab: int, problems: list[Problem]) -> None:
    """The byte tokenizer's ids fit the model's vocab (the resolved one: a preset's, or explicit)."""
    if data.source == DataSource.TEXT and data.tokenizer == BYTE_TOKENIZER and vocab < BYTE_VOCAB:
        problems.append(Problem("spec.model.vocab", BYTE_VOCAB_MESSAGE.format(vocab)))


PLUGIN_HF_MESSAGE: Final = ("a model definition of your own (module) is not one of the built-in families: "
                            "remove family and hfDir (the Hugging Face conversion covers the built-in "
                            "families)")
# A Hugging Face directory is read in the pod only: the cluster resolves the model from a preset or these.
HF_DIMS: Final = ("family", "dim", "layers", "heads", "kvHeads", "vocab", "ffnDim", "seqLen", "ropeTheta",
                  "normEps")


def hf_dims_message(missing: list[str] | tuple[str, ...]) -> str:
    return ("hfDir is read in the pod only: the cluster needs a preset (e.g. qwen3-1.7b) or the model's dims "
            f"in spec.model, and {', '.join(missing)} missing; `tetrad model DIR` prints them from the "
            "directory's config.json (docs/models.md)")


FAMILY_PRESET_MESSAGE: Final = ("family contradicts the preset's family; remove family, or name a preset of"
                                " that family")


# runPolicy: the exit-code lists and the backoff must not contradict each other or the operator's policy.
PERMANENT_DEFAULT: Final = RunPolicy.model_fields["permanent_exit_codes"].get_default(
    call_default_factory=True)
ALWAYS_RETRIED_MESSAGE: Final = (
    f"exit codes {' and '.join(map(str, EXIT_ALWAYS_RETRIED))} are always retried as disruptions (a node "
    "that failed the preflight gate, a preempted trainer that saved), whatever the lists say: remove them "
    "from permanentExitCodes")
BOTH_LISTS_MESSAGE: Final = ("an exit code in both retryableExitCodes and permanentExitCodes (default "
                             f"{PERMANENT_DEFAULT}) fails the job: remove it from one of the lists")
BACKOFF_MESSAGE: Final = ("backoffMaxSeconds={} is below backoffSeconds={}: the cap would cut even the first "
                          "delay; set backoffMaxSeconds to at least backoffSeconds")


def check_run_policy(policy: RunPolicy, problems: list[Problem]) -> None:
    """No always-retried code listed as permanent, no code in both lists, a backoff cap above its start."""
    if listed := sorted({c for c in policy.permanent_exit_codes if c in EXIT_ALWAYS_RETRIED}):
        problems.append(Problem("spec.runPolicy.permanentExitCodes",
                                f"lists {listed}: {ALWAYS_RETRIED_MESSAGE}"))
    if both := sorted(set(policy.retryable_exit_codes) & set(policy.permanent_exit_codes)):
        problems.append(Problem("spec.runPolicy.retryableExitCodes", f"{both} (permanentExitCodes is "
                                f"{policy.permanent_exit_codes}): {BOTH_LISTS_MESSAGE}"))
    if policy.backoff_max_seconds < policy.backoff_seconds:
        problems.append(Problem("spec.runPolicy.backoffMaxSeconds",
                                BACKOFF_MESSAGE.format(policy.backoff_max_seconds, policy.backoff_seconds)))


# What spec.elastic needs, said once for Python and CEL (tetrad.api.crd).
ELASTIC_MIN_MESSAGE: Final = "elastic.minNodes={} is more than nodes={}: use a minNodes of at most nodes"
ELASTIC_SCHEDULER_MESSAGE: Final = ("elastic needs gang.scheduler: builtin, whose admission counts the room "
                                    "for the job's pods; remove spec.elastic or use the builtin gang")


def check_elastic(spec: ParallelTrainingJobSpec, problems: list[Problem]) -> None:
    """minNodes within nodes, and the gang the operator admits itself (it must know how many pods fit)."""
    e = spec.elastic
    if e is None:
        return
    if e.min_nodes > spec.nodes:
        problems.append(Problem("spec.elastic.minNodes", ELASTIC_MIN_MESSAGE.format(e.min_nodes, spec.nodes)))
    if spec.gang.scheduler != Scheduler.BUILTIN:
        problems.append(Problem("spec.elastic", ELASTIC_SCHEDULER_MESSAGE))


# What float8 (training.float8.recipe) needs, each said once for Python, CEL (tetrad.api.crd) and the
# trainer's device check.
FLOAT8_FIELD: Final = "spec.training.float8.recipe"
FLOAT8_NEEDS: Final = {
    "compile": "float8 needs training.compile: true (torchao's float8 casts are fast only compiled); set "
               "compile: true or float8.recipe: none",
    "precision": "float8 trains a bf16 model; set training.precision: bf16 or float8.recipe: none",
    "gpu": "float8 needs NVIDIA GPUs of compute capability 8.9 or newer (H100, H200, L4, L40S, B200); set "
           "resources.gpu or float8.recipe: none",
    "tp": "float8 with tensor parallelism is not supported yet; use tp: 1 (shard with dpShard) or "
          "float8.recipe: none",
}


def check_float8(training: Training, resources: Resources | None, problems: list[Problem]) -> None:
    """float8 runs compiled bf16 training on GPUs that have float8 matmuls (resources None: not known here,
    the trainer checks the device)."""
    if training.float8.recipe == Float8Recipe.NONE:
        return
    field = FLOAT8_FIELD
    if not training.compile:
        problems.append(Problem(field, FLOAT8_NEEDS["compile"]))
    if training.precision != Precision.BF16:
        problems.append(Problem(field, FLOAT8_NEEDS["precision"]))
    if resources is None:
        return
    if resources.gpu == 0:
        problems.append(Problem(field, FLOAT8_NEEDS["gpu"]))
    elif (resources.gpu_type and (found := find_accelerator(resources.gpu_type))
          and not found[1].float8_tflops):
        problems.append(Problem(field, (
            f"resources.gpuType={resources.gpu_type}: the {found[0]} has no float8 matmuls (compute "
            "capability below 8.9); use an H100, H200, L4, L40S or B200, or float8.recipe: none")))


def check_float8_layout(training: Training, layout: Layout, problems: list[Problem]) -> None:
    if training.float8.recipe != Float8Recipe.NONE and layout.tp > 1:
        problems.append(Problem(FLOAT8_FIELD, FLOAT8_NEEDS["tp"]))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def compiles_loss(compile_blocks: bool, tp: int, loss_chunks: int) -> bool:
    """training.compile compiles the loss too, unless its logits are vocab-sharded DTensors (loss
    parallel, tp > 1) or it is chunked (each slice recomputed under checkpointing, eager)."""
    return compile_blocks and tp == 1 and loss_chunks == 1


def pipeline_units(layers: int) -> int:
    """What the pipeline split distributes over the stages: the blocks, the embedding and the output."""
    return layers + NON_BLOCK_STAGE_UNITS


def max_pipeline_stages(layers: int) -> int:
    """The most pipeline stages a model of `layers` blocks splits into, every stage holding a unit."""
    return pipeline_units(layers)


def default_stages_per_rank(schedule: PPSchedule) -> int:
    return DEFAULT_MULTI_STAGES_PER_RANK if schedule in MULTI_STAGE else 1


def stages_per_rank(spec: ParallelTrainingJobSpec) -> int:
    p = spec.parallelism
    return (p.pp_stages_per_rank if p.pp_stages_per_rank is not None
            else default_stages_per_rank(p.pp_schedule))


def microbatches(spec: ParallelTrainingJobSpec, layout: Layout) -> int:
    p = spec.parallelism
    return p.pp_microbatches if p.pp_microbatches is not None else layout.pp * stages_per_rank(spec)


def check_pipeline(schedule: PPSchedule, pp: int, per_rank: int, n_microbatches: int, layers: int,
                   problems: list[Problem]) -> None:
    """Stages, schedule and microbatches of a pipeline (pp > 1)."""
    par = "spec.parallelism"
    stages = pp * per_rank
    limit = max_pipeline_stages(layers)
    if stages > limit:
        field = f"{par}.pp" if per_rank == 1 else f"{par}.ppStagesPerRank"
        problems.append(Problem(field, (
            f"pp*ppStagesPerRank = {pp}*{per_rank} = {stages} stages exceed layers={layers} + "
            f"{NON_BLOCK_STAGE_UNITS} (the embedding and the output take a stage each); use at most "
            f"{limit} stages")))
    multi = schedule in MULTI_STAGE
    if multi and per_rank < 2:
        problems.append(Problem(f"{par}.ppStagesPerRank", (
            f"ppSchedule={schedule.value} needs ppStagesPerRank >= 2 (got {per_rank}); set it to 2"
            " or use 1F1B")))
    if not multi and per_rank != 1:
        problems.append(Problem(f"{par}.ppStagesPerRank", (
            f"ppSchedule={schedule.value} runs one stage per rank (got {per_rank}); set ppStagesPerRank: 1"
            " or use Interleaved1F1B")))
    if schedule == PPSchedule.ZERO_BUBBLE and per_rank != ZERO_BUBBLE_STAGES_PER_RANK:
        problems.append(Problem(f"{par}.ppStagesPerRank", (
            f"ppSchedule=ZeroBubble uses the V-shaped schedule with {ZERO_BUBBLE_STAGES_PER_RANK} stages per "
            f"rank (got {per_rank}); set ppStagesPerRank: {ZERO_BUBBLE_STAGES_PER_RANK}")))
    if n_microbatches < stages:
        problems.append(Problem(f"{par}.ppMicrobatches", (
            f"ppMicrobatches={n_microbatches} is below the {stages} pipeline stages"
            f" (pp={pp} x {per_rank} per rank); use ppMicrobatches >= {stages}")))
    if multi and n_microbatches % pp:
        problems.append(Problem(f"{par}.ppMicrobatches", (
            f"ppMicrobatches={n_microbatches} must be a multiple of pp={pp} for {schedule.value};"
            f" use {n_microbatches + pp - n_microbatches % pp}")))


def check_batch(training: Training, layout: Layout, n_microbatches: int, problems: list[Problem]) -> None:
    """The global batch splits over the data-parallel ranks, then into pipeline microbatches or microBatch."""
    gb, dp = training.global_batch, layout.dp
    if gb % dp:
        problems.append(Problem("spec.training.globalBatch", (
            f"globalBatch={gb} must be divisible by dpReplicate*dpShard = {dp}; use {gb + dp - gb % dp}")))
        return
    local = gb // dp
    if layout.pp > 1:
        if local % n_microbatches:
            problems.append(Problem("spec.training.globalBatch", (
                f"the per-rank batch globalBatch/dp = {gb}/{dp} = {local} must split into"
                f" ppMicrobatches={n_microbatches}; make globalBatch a multiple of {dp * n_microbatches}")))
    elif local % training.micro_batch:
        problems.append(Problem("spec.training.microBatch", (
            f"microBatch={training.micro_batch} must divide the per-rank batch"
            f" globalBatch/dp = {gb}/{dp} = {local}; use a divisor of {local}")))


def check_fsdp(training: Training, layout: Layout, problems: list[Problem]) -> None:
    """training.fsdp acts on FSDP alone: the layout must shard parameters (dpShard*cp > 1)."""
    shard = layout.dp_shard * layout.cp
    if shard > 1:
        return
    if training.fsdp.offload == Offload.CPU:
        problems.append(Problem("spec.training.fsdp.offload", (
            f"offload=cpu needs FSDP, but dpShard*cp = {layout.dp_shard}*{layout.cp} = 1 shards nothing (DDP "
            "and replication keep every parameter on the device); set dpShard >= 2 or offload: none")))
    if not training.fsdp.reshard_after_forward:
        problems.append(Problem("spec.training.fsdp.reshardAfterForward", (
            f"reshardAfterForward=false has no effect: dpShard*cp = {layout.dp_shard}*{layout.cp} = 1 shards "
            "no parameters, so they are always whole; remove it or set dpShard >= 2"), "warning"))


def check_layout(spec: ParallelTrainingJobSpec, cfg: ModelConfig, layout: Layout,
                 problems: list[Problem]) -> None:
    """Checks that need concrete degrees (explicit, or solved from 'auto')."""
    world = spec.nodes * spec.nproc_per_node
    par = "spec.parallelism"
    if layout.world_size != world:
        problems.append(Problem(par, (
            "the product of the degrees dpReplicate*dpShard*tp*cp*pp = "
            f"{layout.dp_replicate}*{layout.dp_shard}*{layout.tp}*{layout.cp}*{layout.pp} = "
            f"{layout.world_size} must equal nodes*nprocPerNode = {spec.nodes}*{spec.nproc_per_node} = "
            f"{world}; change a degree or set dpShard: auto")))
    if cfg.heads % layout.tp or cfg.kv_heads % layout.tp:
        common = [d for d in divisors(cfg.kv_heads) if cfg.heads % d == 0]
        problems.append(Problem(f"{par}.tp", (
            f"tp={layout.tp} must divide heads={cfg.heads} and kvHeads={cfg.kv_heads}; use one of {common}")))
    chunk = 2 * layout.tp * layout.cp
    if cfg.seq_len % chunk:
        problems.append(Problem("spec.model.seqLen", (
            f"seqLen={cfg.seq_len} must be divisible by tp*2*cp = {layout.tp}*2*{layout.cp} = {chunk};"
            f" use seqLen {cfg.seq_len - cfg.seq_len % chunk or chunk} or "
            f"{cfg.seq_len + chunk - cfg.seq_len % chunk}")))
    n_microbatches = microbatches(spec, layout)
    if layout.pp > 1:
        check_pipeline(spec.parallelism.pp_schedule, layout.pp, stages_per_rank(spec), n_microbatches,
                       cfg.layers, problems)
    check_batch(spec.training, layout, n_microbatches, problems)
    check_fsdp(spec.training, layout, problems)
    check_float8_layout(spec.training, layout, problems)
    if layout.tp > spec.nproc_per_node:
        problems.append(Problem(f"{par}.tp", (
            f"tp={layout.tp} spans nodes (nprocPerNode={spec.nproc_per_node});"
            " TP is fastest within a node"), "warning"))


def check_resolved(cfg: ResolvedConfig) -> list[Problem]:
    """The pipeline, batch and data rules for a resolved config (the trainer's check of configs written by
    hand)."""
    problems: list[Problem] = []
    if cfg.model is None:
        problems.append(Problem("script", (
            "the config is a script job's (spec.script): Tetrad's trainer has no model to train")))
        return problems
    if cfg.layout.pp > 1:
        check_pipeline(cfg.pp_schedule, cfg.layout.pp, cfg.pp_stages_per_rank, cfg.pp_microbatches,
                       cfg.model.layers, problems)
    check_batch(cfg.training, cfg.layout, cfg.pp_microbatches, problems)
    check_fsdp(cfg.training, cfg.layout, problems)
    check_float8(cfg.training, None, problems)
    check_float8_layout(cfg.training, cfg.layout, problems)
    check_data(cfg.data, problems)
    check_data_vocab(cfg.data, cfg.model.vocab, problems)
    return problems
