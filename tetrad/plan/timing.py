"""Predicted step time of a layout on GPUs: compute, exposed communication and pipeline bubble.

A first-order model, documented term by term in docs/planner.md and calibrated against one-GPU
runs (bench/gpu.py): matmuls run at MATMUL_EFFICIENCY of the datasheet peak and attention at
ATTENTION_EFFICIENCY; the memory-bound kernels (norms, activations, the loss, the optimizer step) move
the estimate's bytes at the memory bandwidth. FSDP and replicate traffic overlaps with compute; TP, CP
and pipeline traffic does not. Each mesh dim's traffic moves at NVLink speed when its groups stay
inside a node, else at network speed.
"""

from __future__ import annotations

from dataclasses import dataclass

from tetrad.api.accelerators import Accelerator
from tetrad.api.resolved import Layout
from tetrad.api.spec import PPSchedule
from tetrad.plan.estimate import FSDP, Estimate, Workload

# Shares of the datasheet peak, from a torch profile of llama3-1b on an H200 (docs/planner.md): the
# bf16 GEMMs ran at 0.75-0.79. Flash attention's share (its FLOPs counted whole, causal or not) grows with
# the sequence, ATTENTION_EFFICIENCY_MAX * s / (s + ATTENTION_HALF_SEQ_LEN): fitted to the 2,048- to
# 32,768-token runs on an H200.
MATMUL_EFFICIENCY = 0.76
ATTENTION_EFFICIENCY_MAX = 0.8
ATTENTION_HALF_SEQ_LEN = 2048
# float8 matmuls (training.float8) against the float8 peak: set before the first float8 run, which it
# predicted within 2 % (one H200, docs/planner.md).
FLOAT8_MATMUL_EFFICIENCY = 0.6
HOST = "host (CPU offload)"  # the comm key of offload's host <-> device copies
# prefetched all-gathers, reduce-scatters during backward, their copies
OVERLAPPED = (FSDP, "dp_replicate", HOST)
# CPU offload, assumed rather than measured on GPUs yet (docs/planner.md):
HOST_LINK_GBPS = 25.0  # host <-> GPU copies per GPU, one direction: PCIe, shared by the node's GPUs
HOST_ADAMW_PARAMS_PER_S = 5e8  # fused CPU AdamW of one process (one thread of the build host: ~1e8)


@dataclass(frozen=True)
class StepTime:
    accelerator: str
    peak_tflops: float
    compute_s: float
    bubble_s: float
    comm_s: dict[str, float]  # per mesh dim, before any overlap
    exposed_comm_s: float
    tokens_per_device: float
    model_flops: float
    host_optimizer_s: float = 0.0  # CPU offload: AdamW on the host, after the backward

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + self.exposed_comm_s + self.host_optimizer_s

    @property
    def tokens_per_second(self) -> float:
        """Per device."""
        return self.tokens_per_device / self.total_s

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.total_s * self.peak_tflops * 1e12)

    def to_dict(self) -> dict[str, object]:
        return {"accelerator": self.accelerator, "total_s": self.total_s, "compute_s": self.compute_s,
                "bubble_s": self.bubble_s, "exposed_comm_s": self.exposed_comm_s, "comm_s": self.comm_s,
                "host_optimizer_s": self.host_optimizer_s,
                "tokens_per_second_per_device": self.tokens_per_second, "mfu": self.mfu}


def attention_efficiency(seq_len: int) -> float:
    return ATTENTION_EFFICIENCY_MAX * seq_len / (seq_len + ATTENTION_HALF_SEQ_LEN)


def group(layout: Layout, dim: str) -> tuple[int, int]:
    """(stride, size) of dim's process groups in rank order; tp is innermost (MESH_DIMS)."""
    tp, cp, dps, dpr = layout.tp, layout.cp, layout.dp_shard, layout.dp_replicate
    return {"tp": (1, tp), "cp": (tp, cp), FSDP: (tp, dps * cp), "dp_replicate": (tp * cp * dps, dpr),
            "pp": (tp * cp * dps * dpr, layout.pp)}[dim]


def crosses_nodes(layout: Layout, dim: str, nproc_per_node: int) -> bool:
    stride, size = group(layout, dim)
    return stride * size > nproc_per_node


def step_time(est: Estimate, w: Workload, nproc_per_node: int, name: str, acc: Accelerator,
              tokens_per_device: float) -> StepTime:
    layout = est.layout
    peak = acc.peak_tflops * 1e12
    memory_bound = (est.elementwise_bytes + est.optimizer_step_bytes) / (acc.memory_gbps * 1e9)
    float8_peak = (acc.float8_tflops or acc.peak_tflops) * 1e12
    compute = ((est.hardware_flops - est.attention_flops - est.float8_flops) / (peak * MATMUL_EFFICIENCY)
               + est.float8_flops / (float8_peak * FLOAT8_MATMUL_EFFICIENCY)
               + est.attention_flops / (peak * attention_efficiency(est.seq_len)) + memory_bound)
    bubble = 0.0
    if layout.pp > 1:
        # (pp-1) idle slots per (microbatches x virtual stages); zero-bubble fills about half of them
        fraction = (layout.pp - 1) / (w.pp_microbatches * w.pp_stages_per_rank)
        bubble = compute * fraction * (0.5 if w.pp_schedule == PPSchedule.ZERO_BUBBLE else 1.0)
    comm = {dim: sent / ((acc.inter_node_gbps if crosses_nodes(layout, dim, nproc_per_node)
                          else acc.intra_node_gbps) * 1e9)
            for dim, sent in est.comm_bytes.items()}
    if est.host_copy_bytes:
        comm[HOST] = est.host_copy_bytes / (HOST_LINK_GBPS * 1e9)
    hidden = sum(t for dim, t in comm.items() if dim in OVERLAPPED)
    exposed = max(hidden - compute, 0.0) + sum(t for dim, t in comm.items() if dim not in OVERLAPPED)
    return StepTime(name, acc.peak_tflops, compute, bubble, comm, exposed, tokens_per_device, est.model_flops,
                    host_optimizer_s=est.host_params / HOST_ADAMW_PARAMS_PER_S)
