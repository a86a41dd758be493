"""What this machine has, where it decides whether or how fast a CPU job trains: its memory, and
whether its CPU has a fast bf16 matmul.

torch runs a bf16 matmul on an x86 CPU through oneDNN when the CPU has AVX-512 (F, BW, VL, DQ; with
AVX512_BF16 or AMX natively, else emulated in wide registers); without AVX-512 it falls back to a
scalar loop, about 10x slower than fp32 on the debug model (docs/trainer.md). Standard library only:
`tetrad run` says it before anything starts, the trainer in its first lines.
"""

from __future__ import annotations

import platform
from pathlib import Path

AVX512_CORE = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first processor's flags in /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def slow_bf16_warning(machine: str | None = None, cpuinfo: str | None = None) -> str | None:
    """A warning for bf16 training on this CPU when it has no fast bf16 matmul; None when it has one or
    this cannot tell (not x86, no /proc/cpuinfo)."""
    if (machine or platform.machine()) not in ("x86_64", "AMD64"):
        return None
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return None
    flags = cpu_flags(cpuinfo)
    if not flags or flags >= AVX512_CORE:
        return None
    return ("spec.training.precision: bf16 on this CPU (no AVX-512) runs every matmul without a native"
            " kernel, about 10x slower than fp32; set training.precision: fp32 to train on CPU")


def memory_bytes(meminfo: str | None = None) -> int | None:
    """This machine's memory (MemTotal of /proc/meminfo); None when it cannot tell."""
    if meminfo is None:
        try:
            meminfo = Path("/proc/meminfo").read_text(errors="replace")
        except OSError:
            return None
    for line in meminfo.splitlines():
        key, _, value = line.partition(":")
        if key == "MemTotal" and (fields := value.split()) and fields[0].isdigit():
            return int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return None
