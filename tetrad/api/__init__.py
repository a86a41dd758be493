"""The ParallelTrainingJob API model, the bottom layer: spec and status, presets, the pod contract,
the shared rules, the resolved trainer config and manifest parsing. It imports nothing else of Tetrad;
validation and resolution (tetrad.resolve) and the planner (tetrad.plan) sit above it."""

from tetrad.api.manifest import parse
from tetrad.api.problems import InvalidJob, Problem
from tetrad.api.resolved import Layout, ModelConfig, ResolvedConfig
from tetrad.api.spec import ParallelTrainingJob, ParallelTrainingJobSpec, ParallelTrainingJobStatus

__all__ = [
    "InvalidJob", "Layout", "ModelConfig", "ParallelTrainingJob", "ParallelTrainingJobSpec",
    "ParallelTrainingJobStatus", "Problem", "ResolvedConfig", "parse",
]
