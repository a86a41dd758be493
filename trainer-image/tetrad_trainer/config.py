"""Loading the resolved config, and the error for configs the trainer cannot run.

Every check that needs only the config runs here, on every rank before any collective, so all
ranks exit with 78 together instead of one rank leaving its peers stuck in the mesh set-up.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from tetrad.api.problems import errors
from tetrad.api.resolved import ResolvedConfig
from tetrad.api.rules import check_resolved


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
    """The batch and pipeline rules validation applies (tetrad.api.rules), for configs written by hand."""
    if problems := errors(check_resolved(cfg)):
        raise ConfigError("; ".join(str(p) for p in problems))
