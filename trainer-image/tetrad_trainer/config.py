"""Loading the resolved config, and the error for configs the trainer cannot run.

Every check that needs only the config runs here, on every rank before any collective, so all
ranks exit with 78 together instead of one rank leaving its peers stuck in the mesh set-up.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from tetrad.api.resolved import ResolvedConfig
from tetrad.api.spec import PPSchedule

MULTI_STAGE = (PPSchedule.INTERLEAVED_1F1B, PPSchedule.ZERO_BUBBLE)


class ConfigError(Exception):
    """The resolved config cannot run here; the trainer exits with EXIT_CONFIG_ERROR (78)."""


def load_config(path: str | Path, *, steps: int | None = None) -> ResolvedConfig:
    """Read the resolved config; steps, when given, replaces training.steps (schedule included)."""
    try:
        cfg = ResolvedConfig.load(path)
    except FileNotFoundError as e:
        raise ConfigError(f"config file {path} does not exist") from e
    except (ValueError, ValidationError) as e:
        raise ConfigError(f"config file {path} is not a valid resolved config: {e}") from e
    if steps is not None:
        if steps < 1:
            raise ConfigError(f"--steps={steps} must be >= 1")
        cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"steps": steps})})
    check_runnable(cfg)
    return cfg


def check_runnable(cfg: ResolvedConfig) -> None:
    """The batch and pipeline conditions validation also checks, repeated for configs written by hand."""
    if cfg.training.global_batch % cfg.layout.dp:
        raise ConfigError(f"globalBatch={cfg.training.global_batch} is not divisible by dp={cfg.layout.dp}")
    if cfg.layout.pp > 1:
        check_pipeline(cfg)


def check_pipeline(cfg: ResolvedConfig) -> None:
    pp, spr, n_mb = cfg.layout.pp, cfg.pp_stages_per_rank, cfg.pp_microbatches
    stages = pp * spr
    if cfg.pp_schedule in MULTI_STAGE and spr < 2:
        raise ConfigError(f"ppSchedule={cfg.pp_schedule.value} needs ppStagesPerRank >= 2, got {spr}")
    if cfg.pp_schedule == PPSchedule.ZERO_BUBBLE and spr != 2:
        raise ConfigError(f"ppSchedule=ZeroBubble runs 2 stages per rank in V order, got ppStagesPerRank={spr}")
    if cfg.pp_schedule not in MULTI_STAGE and spr != 1:
        raise ConfigError(f"ppSchedule={cfg.pp_schedule.value} runs one stage per rank, got ppStagesPerRank={spr}")
    if stages > cfg.model.layers + 2:
        raise ConfigError(f"{stages} pipeline stages (pp={pp} x {spr}) exceed the model's {cfg.model.layers} layers + 2")
    if n_mb < stages:
        raise ConfigError(f"ppMicrobatches={n_mb} is below the {stages} pipeline stages (pp={pp} x {spr} per rank)")
    local_batch = cfg.training.global_batch // cfg.layout.dp
    if local_batch % n_mb:
        raise ConfigError(f"the per-rank batch globalBatch/dp = {local_batch} does not split into ppMicrobatches={n_mb}")
