"""DFlash: a block-diffusion drafter that drafts a whole block of tokens in one forward pass.

    config.py    DFlashConfig: geometry and target layers from the target, the MASK token (pick_mask_token)
    model.py     DFlashDrafter: the layers, anchors and the training pass, and what every stage asks of the kind
    session.py   DFlashSession: one sequence's context K/V cache and block drafting
    formats.py   its served format, dflash (and a learned MASK row's mask_embedding.pt)
"""

from vatspec.drafters.dflash.config import DFlashConfig, default_target_layer_ids, pick_mask_token
from vatspec.drafters.dflash.formats import DFLASH
from vatspec.drafters.dflash.model import Anchors, DFlashDrafter
from vatspec.drafters.dflash.session import DFlashSession

__all__ = ["DFLASH", "Anchors", "DFlashConfig", "DFlashDrafter", "DFlashSession", "default_target_layer_ids",
           "pick_mask_token"]
