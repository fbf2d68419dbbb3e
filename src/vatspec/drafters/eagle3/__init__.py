"""EAGLE-3: one Llama decoder layer over fused target features, trained by a test-time unroll.

    config.py    Eagle3Config: the draft's geometry, RoPE and target layers, from the target
    model.py     Eagle3Drafter: the layer, the training unroll, and what every stage asks of the kind
    session.py   Eagle3Session: chain drafting for one sequence with the draft's own KV cache
    formats.py   its served formats, eagle3-hf and speculators: written, validated, read back, checked
"""

from vatspec.drafters.eagle3.config import (
    DEFAULT_TTT_STEPS,
    DRAFT_ROPE_TYPES,
    Eagle3Config,
    default_layer_ids,
    rope_from_config,
)
from vatspec.drafters.eagle3.formats import EAGLE3_HF, SPECULATORS
from vatspec.drafters.eagle3.model import Eagle3Drafter
from vatspec.drafters.eagle3.session import Eagle3Session

__all__ = ["DEFAULT_TTT_STEPS", "DRAFT_ROPE_TYPES", "EAGLE3_HF", "SPECULATORS", "Eagle3Config", "Eagle3Drafter",
           "Eagle3Session", "default_layer_ids", "rope_from_config"]
