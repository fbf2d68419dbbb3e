"""Served draft formats: export to SGLang / vLLM / speculators, import back, validate on the way.

    formats.py   the formats by name (each its drafter's: ``Drafter.formats``), which one a config.json is
    write.py     formats out: ``export_draft``, validated before it is renamed in place
    validate.py  ``validate_export``: an export folder against its format and, given one, the target
    read.py      formats in: ``import_draft``, ``load_accept_head``

    vatspec export RUN_OR_CHECKPOINT [--format eagle3-hf|speculators|dflash] --out DIR

An export folder holds ``config.json`` and ``model.safetensors`` exactly as the engines read them
(docs/serving.md lists every field), plus ``accept_head/`` when the draft has one: VAT's head is
never inside the served weights (vLLM rejects unknown keys), engines never look into the subfolder.

Each format belongs to its drafter (``Drafter.formats``: ``vatspec/drafters/eagle3/formats.py`` holds
eagle3-hf and speculators, ``vatspec/drafters/dflash/formats.py`` dflash, each with its table of files, fields
and tensors): it builds the config.json and the served tensors, validates and reads them. This package keeps
what every format shares: the folder written atomically and validated before it is renamed in place, the
record (``vatspec.json``), the model card (``README.md``), the accept head, and which format a folder is.

Layer ids (ours: id i = output of decoder layer i, ``vatspec.target``) are written in each
engine's own convention, which differ: SGLang's EAGLE-3 and every DFlash field count the output of layer i
(written as ours); vLLM's ``eagle_aux_hidden_state_layer_ids`` the input of layer j (ours + 1,
``to_vllm_ids``). The formats' modules say which field is whose.

Import (``import_draft``) reads every format, including third-party drafts (bf16,
``pytorch_model.bin``, an ``embed_tokens.weight`` equal to the target's), into this project's
drafter classes, and fails with the field at fault when the draft does not fit the target.
Commands open any draft, served or a training checkpoint, with ``vatspec.drafts.open_draft``.
"""

from vatspec.export.formats import (
    CONFIG_KEYS,
    FORMATS,
    ExportError,
    default_format,
    served_format,
    to_vllm_ids,
)
from vatspec.export.read import import_draft, load_accept_head
from vatspec.export.validate import validate_export
from vatspec.export.write import export_draft

__all__ = [
    "CONFIG_KEYS",
    "ExportError",
    "FORMATS",
    "default_format",
    "export_draft",
    "import_draft",
    "load_accept_head",
    "served_format",
    "to_vllm_ids",
    "validate_export",
]
