"""The ParallelTrainingJob API: spec and status models, presets, validation, the auto-degree solver."""

from tetrad.api.resolve import resolve
from tetrad.api.resolved import Layout, ModelConfig, ResolvedConfig
from tetrad.api.spec import ParallelTrainingJob, ParallelTrainingJobSpec, ParallelTrainingJobStatus
from tetrad.api.validation import InvalidJob, Problem, parse, validate_document, validate_spec

__all__ = [
    "InvalidJob", "Layout", "ModelConfig", "ParallelTrainingJob", "ParallelTrainingJobSpec",
    "ParallelTrainingJobStatus", "Problem", "ResolvedConfig", "parse", "resolve", "validate_document", "validate_spec",
]
