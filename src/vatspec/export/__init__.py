"""Served draft formats: export to SGLang / vLLM / speculators, import back, validate on the way.

    formats.py   the formats' tables: files, config keys, tensor names and shapes, layer-id conversion
    write.py     formats out: ``export_draft`` (and ``build_config``), validated before it is renamed in place
    validate.py  ``validate_export``: an export folder against its format and, given one, the target
    read.py      formats in: ``import_draft``, ``load_accept_head``

    vatspec export RUN_OR_CHECKPOINT [--format eagle3-hf|speculators|dflash] --out DIR

An export folder holds ``config.json`` and ``model.safetensors`` exactly as the engines read them
(docs/serving.md lists every field), plus ``accept_head/`` when the draft has one: VAT's head is
never inside the served weights (vLLM rejects unknown keys), engines never look into the subfolder.

=============  ======================================  ===========================================
format         config.json                             weights (no embedding: the target's)
=============  ======================================  ===========================================
eagle3-hf      LlamaConfig, LlamaForCausalLMEagle3     midlayer.*, fc, norm, lm_head, d2t, t2d
speculators    Eagle3Speculator + transformer_layer_   layers.0.*, fc, norm, lm_head, d2t, t2d
               config + speculators_config
dflash         DFlashDraftModel, model_type of the     layers.i.*, fc, hidden_norm, norm (no
               target, dflash_config                   lm_head: the target's)
=============  ======================================  ===========================================

Layer ids (ours: id i = output of decoder layer i, ``vatspec.target``) are written in each
engine's own convention, which differ:

* SGLang, EAGLE-3: ``eagle_config.eagle_aux_hidden_state_layer_ids`` = output of layer i; SGLang
  adds 1 and captures the residual stream entering layer i + 1. Written as ours.
* vLLM, EAGLE-3 (both formats): top-level ``eagle_aux_hidden_state_layer_ids``, used as given: it
  captures the stream *entering* layer j, i.e. the output of layer j - 1. Written as ours + 1.
* DFlash (z-lab reference, SGLang, vLLM): ``dflash_config.target_layer_ids`` = output of layer i
  (reference: ``hidden_states[i + 1]``; both engines add 1). Written as ours; the vLLM field is
  written too (ours + 1) so vLLM builds without the DFlash fallback read the same layers.

The defaults agree: EAGLE-3 outputs of 1, L//2-1, L-4 are SGLang's and vLLM's ``[2, L//2, L-3]``.

Import (``import_draft``) reads the three formats, including third-party drafts (bf16,
``pytorch_model.bin``, an ``embed_tokens.weight`` equal to the target's), into this project's
drafter classes, and fails with the field at fault when the draft does not fit the target.
Commands open any draft, served or a training checkpoint, with ``vatspec.drafts.open_draft``.
"""

from vatspec.export.formats import (
    CONFIG_KEYS,
    DEFAULT_FORMAT,
    FORMATS,
    ExportError,
    detect_format,
    expected_weights,
    to_vllm_ids,
)
from vatspec.export.read import import_draft, load_accept_head
from vatspec.export.validate import validate_export
from vatspec.export.write import build_config, export_draft

__all__ = [
    "CONFIG_KEYS",
    "DEFAULT_FORMAT",
    "ExportError",
    "FORMATS",
    "build_config",
    "detect_format",
    "expected_weights",
    "export_draft",
    "import_draft",
    "load_accept_head",
    "to_vllm_ids",
    "validate_export",
]
