"""The built-in Llama and the initialization scheme under their former names (re-exported).

The model now lives in `tetrad_trainer.models.llama`, the layout-independent initialization in
`tetrad_trainer.models.init`; both follow the model interface of `tetrad_trainer.models`.
"""

from tetrad_trainer.models.init import (
    TILE,
    canonical_name,
    init_weights,
    initial_slice,
    initial_value,
    local_box,
)
from tetrad_trainer.models.interface import CausalAttention
from tetrad_trainer.models.llama import (
    Attention,
    FeedForward,
    Transformer,
    TransformerBlock,
    apply_rope,
    rope_tables,
)

__all__ = ["TILE", "Attention", "CausalAttention", "FeedForward", "Transformer", "TransformerBlock",
           "apply_rope", "canonical_name", "init_weights", "initial_slice", "initial_value", "local_box",
           "rope_tables"]
