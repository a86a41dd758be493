"""Per-device memory, step FLOPs and per-dimension communication of one layout.

The formulas are documented, term by term, in docs/planner.md; keep the two in step.
All figures are per device and per optimizer step unless named otherwise.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from tetrad.api.resolved import Layout, ModelConfig
from tetrad.api.rules import compiles_loss, pipeline_units
from tetrad.api.spec import ActivationCheckpointing, Float8Recipe, PPSchedule, Precision

GiB = 1024**3
MiB = 1024**2
FSDP = "dp_shard*cp (FSDP)"  # the comm key of the flattened FSDP dim
# Bytes per logit at the loss's peak, in its backward: the fp32 log-probabilities saved by the
# forward, and the fp32 gradient into and out of log-softmax (the compute-dtype logits and their
# fp32 copy, 6 bytes in bf16, are freed by then and peak lower in the forward).
LOSS_BYTES_PER_LOGIT = 12
# The compiled loss (tetrad.api.rules.compiles_loss) keeps no fp32 copy: the bf16 logits and their
# bf16 gradient (measured on an H200, docs/planner.md).
COMPILED_LOSS_BYTES_PER_LOGIT = 4
# Saved activations of one block per [s, b, h] of 16-bit words (Korthikanti et al. 2022, with SP and
# fused attention: 34); per-block torch.compile saves less, recomputing elementwise ops in the
# backward (measured on an H200: 14).
BLOCK_ACTIVATION_WORDS = {False: 34, True: 14}  # by training.compile
# Bytes the memory-bound kernels move per token, block and model dim: measured on an H200 (docs/planner.md)
ELEMENTWISE_BYTES = {False: 1050.0, True: 400.0}  # by training.compile: eager, or fused by inductor
# Per parameter on the device: the norm reads the fp32 gradient, fused AdamW reads the parameter, the
# gradient and both moments and writes them back; 52 at the bandwidth these kernels reach (H200).
OPTIMIZER_STEP_BYTES_PER_PARAM = 52.0
# float8 (training.float8): the casts of the converted layers' inputs and output gradients, with their
# scales' reductions, per token, block and model dim; and of their weights, twice per microbatch (for the
# forward and for the input gradient), per parameter: from the tensors each cast reads and writes, not
# fitted (docs/planner.md).
FLOAT8_ACTIVATION_CAST_BYTES = 150.0
FLOAT8_WEIGHT_CAST_BYTES_PER_PARAM = 20.0
# The casts of each recipe against tensorwise's. Rowwise scales each row of every operand, and each column
# for the transposed GEMMs, with power-of-2 scales: fitted to one H200 run whose profile showed its casts
# as long as its float8 GEMMs. rowwise_with_gw_hp runs the weight gradient in bf16 and skips its operands'
# casts: two thirds of rowwise's, assumed (not measured).
FLOAT8_CAST_FACTOR = {Float8Recipe.TENSORWISE: 1.0, Float8Recipe.ROWWISE: 2.6,
                      Float8Recipe.ROWWISE_WITH_GW_HP: 1.75}
# Share of the transient memory (activations and the loss) the caching allocator loses to fragmentation.
FRAGMENTATION = 0.05


def count_text(n: float) -> str:
    """A count in readable units, three significant digits: 4.19M, 8.03B, 950."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


@dataclass(frozen=True)
class Workload:
    """What besides the layout decides the cost: batch, numerics and pipeline settings."""

    global_batch: int
    micro_batch: int
    precision: Precision = Precision.BF16
    ac: ActivationCheckpointing = ActivationCheckpointing.NONE
    pp_schedule: PPSchedule = PPSchedule.ONE_F_ONE_B
    pp_microbatches: int = 1
    pp_stages_per_rank: int = 1
    loss_chunks: int = 1
    compile: bool = False  # training.compile: blocks, and the loss where compiles_loss says so
    reshard_after_forward: bool = True  # training.fsdp.reshardAfterForward (false: ZeRO-2 behaviour)
    offload: bool = False  # training.fsdp.offload: cpu
    float8: Float8Recipe = Float8Recipe.NONE  # training.float8.recipe: the blocks' linear layers
    float8_output: bool = False  # training.float8.output: the output projection too


@dataclass
class Estimate:
    layout: Layout
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float  # the saved activations of the microbatches in flight and the loss at its peak
    buffers_bytes: float
    model_flops: float  # per device, 6N + attention
    hardware_flops: float  # per device, with activation recompute
    attention_flops: float = 0.0  # the part of hardware_flops in attention, recompute included
    float8_flops: float = 0.0  # the part of hardware_flops in float8 matmuls, recompute included
    seq_len: int = 0  # the model's: flash attention's efficiency depends on it (tetrad.plan.timing)
    # bytes the memory-bound kernels move per device and step, besides the matmuls and attention:
    elementwise_bytes: float = 0.0  # norms, activations, rotary, residuals, casts, the loss
    optimizer_step_bytes: float = 0.0  # the clipping's norm and fused AdamW over the device's params
    comm_bytes: dict[str, float] = field(default_factory=dict)  # per mesh dim, bytes sent per device
    fragmentation_bytes: float = 0.0  # FRAGMENTATION of the activations (the loss's logits included)
    # host memory per process: the sharded params, grads and AdamW state under CPU offload
    host_bytes: float = 0.0
    host_params: float = 0.0  # parameters the CPU optimizer steps per process under CPU offload
    host_copy_bytes: float = 0.0  # bytes copied between host and device per step under CPU offload

    @property
    def peak_bytes(self) -> float:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes
                + self.buffers_bytes + self.fragmentation_bytes)

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["layout"] = self.layout.model_dump(by_alias=True)
        d["peak_bytes"] = self.peak_bytes
        return d


def _ring(n: int) -> float:
    """Fraction of a buffer each rank sends in a ring all-gather or reduce-scatter."""
    return (n - 1) / n


def stage_params(m: ModelConfig, layout: Layout, stages_per_rank: int) -> tuple[float, int]:
    """(params of the largest pipeline stage on one rank, params of one block) before TP/FSDP."""
    total, block = m.num_params(), m.block_params()
    if layout.pp == 1:
        return total, block
    stages = layout.pp * stages_per_rank
    # embedding and output count as one layer each, as the trainer splits them (a tied pair: a copy on each
    # end)
    units_per_stage = math.ceil(pipeline_units(m.layers) / stages)
    embed = m.vocab * m.dim
    largest_stage = (units_per_stage - 1) * block + max(embed, block)
    return largest_stage * stages_per_rank, block


def _host_copies(host_params: float, gathers: int, rounds: int) -> float:
    """CPU offload's copies per step: the fp32 shard to the device for each all-gather, the fp32
    sharded gradient back after each reduce-scatter (per microbatch without a pipeline)."""
    return 4 * host_params * (gathers + 1) * rounds


def estimate(m: ModelConfig, layout: Layout, w: Workload) -> Estimate:
    cbytes = 4 if w.precision == Precision.FP32 else 2
    shard = layout.dp_shard * layout.cp  # FSDP shards over dp_shard x cp
    per_rank = w.pp_stages_per_rank if layout.pp > 1 else 1
    p_rank, p_block = stage_params(m, layout, per_rank)
    p_local = p_rank / layout.tp  # after TP, before FSDP

    params = 4 * p_local / shard  # fp32 sharded master weights
    grads = 4 * p_local / shard
    optim = 8 * p_local / shard  # AdamW exp_avg, exp_avg_sq

    # Unsharded params of the block in compute plus the prefetched next one, and the fp32
    # reduce-scatter input of one block. With pp>1 FSDP keeps the stage unsharded between
    # microbatches (reshard_after_forward=False), and so does ZeRO-2 behaviour from forward to
    # backward: the whole stage is resident.
    resident = layout.pp > 1 or not w.reshard_after_forward
    host = host_params = 0.0
    if shard > 1:
        gathered = p_local if resident else 2 * p_block / layout.tp
        buffers = gathered * cbytes + 4 * p_block / layout.tp
        # the sharded state moves to the host; one block's fp32 shard and its sharded grad pass through
        if w.offload:
            host, params, grads, optim = params + grads + optim, 0.0, 0.0, 0.0
            host_params = p_local / shard
            buffers += 2 * 4 * p_block / layout.tp / shard
    else:
        buffers = 0.0 if cbytes == 4 else p_local * cbytes  # bf16 copy for DDP/single device

    dp = layout.dp
    local_batch = w.global_batch // dp
    if layout.pp > 1:
        mb = max(local_batch // w.pp_microbatches, 1)
        n_micro = w.pp_microbatches
    else:
        mb = w.micro_batch
        n_micro = max(local_batch // w.micro_batch, 1)
    s = m.seq_len / layout.cp
    h = m.dim
    layers_rank = m.layers / layout.pp
    sbh = s * mb * h * cbytes / 2  # bytes of one [s, b, h] tensor in compute dtype, /2 to count 16-bit words
    full_layer = BLOCK_ACTIVATION_WORDS[w.compile] * sbh / layout.tp
    ckpt_layer = 2 * sbh / layout.tp  # only the block input survives
    if w.ac == ActivationCheckpointing.FULL:
        per_mb = layers_rank * ckpt_layer + full_layer
    elif w.ac == ActivationCheckpointing.SELECTIVE:
        per_mb = layers_rank / 2 * (full_layer + ckpt_layer) + full_layer
    else:
        per_mb = layers_rank * full_layer
    if layout.pp > 1:
        in_flight = n_micro if w.pp_schedule == PPSchedule.GPIPE else min(n_micro, layout.pp * per_rank)
    else:
        in_flight = 1
    # The loss over one microbatch's logits, vocab-sharded under TP (loss parallel); the chunked
    # loss holds one slice of the sequence at a time.
    logits = s * mb * m.vocab / layout.tp / max(1, min(w.loss_chunks, int(s)))
    per_logit = (COMPILED_LOSS_BYTES_PER_LOGIT if compiles_loss(w.compile, layout.tp, w.loss_chunks)
                 else LOSS_BYTES_PER_LOGIT)
    activations = per_mb * in_flight + per_logit * logits

    tokens_rank = w.global_batch * m.seq_len / layout.world_size
    model_flops = m.flops_per_token() * tokens_rank
    recompute = {ActivationCheckpointing.FULL: 1 / 3, ActivationCheckpointing.SELECTIVE: 1 / 6}.get(w.ac, 0.0)
    hardware_flops = model_flops * (1 + recompute)
    attention_flops = m.attention_flops_per_token() * tokens_rank * (1 + recompute)

    comm: dict[str, float] = {}
    gathers = 1 if resident else 2  # forward, and again in backward after resharding
    rounds = n_micro if layout.pp == 1 else 1  # a pipeline stage gathers once per step
    if shard > 1:
        comm[FSDP] = (p_local * cbytes * gathers * rounds + p_local * 4) * _ring(shard)
    if layout.dp_replicate > 1:
        comm["dp_replicate"] = 2 * 4 * p_local / shard * _ring(layout.dp_replicate)
    tokens_micro = mb * s
    if layout.tp > 1:
        # SP: per block, all-gather + reduce-scatter around attention and FFN, forward and backward
        comm["tp"] = 8 * layers_rank * tokens_micro * h * cbytes * _ring(layout.tp) * n_micro
    if layout.cp > 1:
        kv = m.kv_heads * m.head_dim / layout.tp
        comm["cp"] = 2 * 2 * layers_rank * mb * m.seq_len * kv * cbytes * _ring(layout.cp) * n_micro
    if layout.pp > 1:
        comm["pp"] = 2 * n_micro * per_rank * tokens_micro * h * cbytes / layout.tp
    if w.loss_chunks > 1:  # each slice's output projection runs again in the backward
        hardware_flops += 2 * m.dim * m.vocab * tokens_rank
    elementwise = ELEMENTWISE_BYTES[w.compile] * tokens_rank * m.layers * h
    float8_flops = 0.0
    if w.float8 != Float8Recipe.NONE:
        linear_params = (m.layers * (m.block_params() - 2 * m.dim)
                         + (m.dim * m.vocab if w.float8_output else 0))
        # forward, recompute and both gradients; rowwise_with_gw_hp's weight gradient (2 of 6) in bf16
        high_precision = 2 if w.float8 == Float8Recipe.ROWWISE_WITH_GW_HP else 0
        float8_flops = (6 * (1 + recompute) - high_precision) * linear_params * tokens_rank
        weights_local = linear_params / layout.pp / layout.tp
        elementwise += FLOAT8_CAST_FACTOR[w.float8] * (
            FLOAT8_ACTIVATION_CAST_BYTES * tokens_rank * m.layers * h
            + FLOAT8_WEIGHT_CAST_BYTES_PER_PARAM * weights_local * n_micro)
    return Estimate(layout, params, grads, optim, activations, buffers, model_flops, hardware_flops,
                    attention_flops, float8_flops, m.seq_len,
                    elementwise_bytes=elementwise,
                    optimizer_step_bytes=OPTIMIZER_STEP_BYTES_PER_PARAM * params / 4, comm_bytes=comm,
                    fragmentation_bytes=FRAGMENTATION * activations, host_bytes=host, host_params=host_params,
                    host_copy_bytes=_host_copies(host_params, gathers, rounds))
