"""Models in Tetrad's trainer: the public interface a model definition is written against.

    from tetrad_trainer.models import ModelDefinition, TensorParallelPlan, CausalAttention, normal, constant

`ModelDefinition` (interface.py) is everything the trainer needs to know about a model; the built-in
Llama (llama.py) is one, and a job names its own with spec.model.module (loader.py).
"""

from tetrad_trainer.loss import cross_entropy_sum
from tetrad_trainer.models.interface import (
    CausalAttention,
    Decoder,
    Draw,
    ModelDefinition,
    TensorParallelPlan,
    constant,
    normal,
    trunc_normal,
)

__all__ = ["CausalAttention", "Decoder", "Draw", "ModelDefinition", "TensorParallelPlan", "constant",
           "cross_entropy_sum", "normal", "trunc_normal"]
