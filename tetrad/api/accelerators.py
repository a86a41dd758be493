"""Datasheet figures of the accelerators the planner and the trainer's MFU know.

Per GPU: dense bf16 peak (fp16 on V100, which has no bf16), the bandwidth to the other GPUs of its
node (NVLink, xGMI or PCIe) and its share of the node's network, one direction, in GB/s, its
memory (HBM or GDDR) bandwidth in GB/s, and its dense float8 peak (None: no float8 matmuls, compute
capability below 8.9).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    peak_tflops: float
    intra_node_gbps: float
    inter_node_gbps: float
    memory_gbps: float
    float8_tflops: float | None = None


ACCELERATORS = {
    "GB200": Accelerator(2500.0, 900.0, 100.0, 8000.0, 5000.0),
    "B200": Accelerator(2250.0, 900.0, 50.0, 8000.0, 4500.0),
    "H200": Accelerator(989.0, 450.0, 50.0, 4800.0, 1979.0),
    "H100 PCIE": Accelerator(756.0, 64.0, 25.0, 2000.0, 1513.0),
    "H100": Accelerator(989.0, 450.0, 50.0, 3350.0, 1979.0),
    "H800": Accelerator(989.0, 200.0, 50.0, 3350.0, 1979.0),
    "H20": Accelerator(148.0, 450.0, 50.0, 4000.0, 296.0),
    "A100": Accelerator(312.0, 300.0, 25.0, 2039.0),
    "A800": Accelerator(312.0, 200.0, 25.0, 2039.0),
    "L40S": Accelerator(362.0, 32.0, 25.0, 864.0, 733.0),
    "L40": Accelerator(181.0, 32.0, 25.0, 864.0, 362.0),
    "L4": Accelerator(121.0, 32.0, 12.5, 300.0, 242.0),
    "A10G": Accelerator(70.0, 32.0, 12.5, 600.0),
    "A10": Accelerator(125.0, 32.0, 12.5, 600.0),
    "MI325X": Accelerator(1307.0, 448.0, 50.0, 6000.0, 2615.0),
    "MI300X": Accelerator(1307.0, 448.0, 50.0, 5300.0, 2615.0),
    "V100": Accelerator(125.0, 150.0, 12.5, 900.0),
}
ASSUMED = "H100"  # for a GPU job that names no known gpuType


def find_accelerator(name: str) -> tuple[str, Accelerator] | None:
    """The table's entry for a GPU name as CUDA or the job reports it, e.g. 'NVIDIA H100 80GB HBM3'."""
    upper = name.upper().replace("-", " ")
    for key in sorted(ACCELERATORS, key=len, reverse=True):
        if key in upper:
            return key, ACCELERATORS[key]
    return None
