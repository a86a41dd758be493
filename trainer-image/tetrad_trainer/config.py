"""Loading the resolved config, and the error for configs the trainer cannot run."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from tetrad.api.resolved import ResolvedConfig


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
    return cfg
