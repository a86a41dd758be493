"""Running out of device memory: a message that says what to change, and the exit code EXIT_OOM.

A training step that raises torch.OutOfMemoryError on a rank becomes DeviceOutOfMemory there; the
trainer logs its message and exits with EXIT_OOM (77), which the operator treats as permanent by
default: the same layout and batch would run out of memory again on every restart.

The message names the step, the device's total and peak memory, the planner's predicted peak
(when the resolved config carries one) and the settings that lower the peak, with their values.

ENV_TEST_OOM_AT_STEP is a fault hook for tests only: with it set to N, every rank raises
torch.OutOfMemoryError at the start of step N, as a real out-of-memory error would surface.
"""

from __future__ import annotations

import os

import torch

from tetrad.api.contract import ENV_TEST_OOM_AT_STEP
from tetrad.api.resolved import ResolvedConfig
from tetrad_trainer.metrics import peak_memory_bytes

GiB = 1024**3


class DeviceOutOfMemory(Exception):
    """A training step ran out of device memory; the trainer exits with EXIT_OOM."""


def total_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def out_of_memory_message(cfg: ResolvedConfig, device: torch.device, step: int, error: BaseException) -> str:
    t, layout = cfg.training, cfg.layout
    peak, reserved = peak_memory_bytes(device)
    predicted = (f"the planner predicted a peak of {cfg.predicted_peak_bytes / GiB:.1f} GiB"
                 if cfg.predicted_peak_bytes is not None else "no planner prediction in the config")
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"out of device memory in step {step} on {device}: {total_memory_bytes(device) / GiB:.1f} GiB total,"
        f" peak {peak / GiB:.1f} GiB allocated ({reserved / GiB:.1f} GiB reserved); {predicted}."
        f" To lower the peak: a smaller training.microBatch (now {t.micro_batch}),"
        f" training.activationCheckpointing selective or full (now {t.activation_checkpointing.value}),"
        f" training.lossChunks > 1 (now {t.loss_chunks}), or more sharding: parallelism.dpShard, tp or pp"
        f" (now dpShard={layout.dp_shard}, tp={layout.tp}, pp={layout.pp}). Error: {first_line}"
    )


def inject_oom_for_tests(at: int | None, step: int) -> None:
    """Raise torch.OutOfMemoryError at step `at` ($TETRAD_TEST_OOM_AT_STEP; None in real runs: never)."""
    if at == step:
        raise torch.OutOfMemoryError(f"injected by {ENV_TEST_OOM_AT_STEP}={at} (test fault hook)")
