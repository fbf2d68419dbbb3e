"""Conversations in, token ids and loss masks out; regeneration of responses by the target.

    records.py   files, folders, HF datasets -> Conversation (DataError names the file and line)
    chat.py      Conversation -> Example: the chat template's token ids and the loss mask
    batching.py  Example -> Batch; BatchIterator, split_heldout, token_counts
    regen.py     regenerate: every assistant turn answered again by the target, resumable
    endpoints.py regenerate_endpoints: the same through OpenAI-compatible servers (vLLM, SGLang, ...)

The bundled prompt sets are ``vatspec.benchmarks``, which reads through this package (never the
other way round).
"""

from vatspec.data.batching import Batch, BatchIterator, collate, split_heldout, token_counts
from vatspec.data.chat import (
    ChatTemplate,
    Example,
    attach_template,
    check_data_template,
    check_settings,
    load_template,
    pin_date,
    recorded_settings,
    split_turns,
    tokenize_conversation,
)
from vatspec.data.records import ROLES, Conversation, DataError, iter_json_array, load_conversations, parse_record
from vatspec.data.regen import RegenStats, regenerate

__all__ = [
    "ROLES",
    "Batch",
    "BatchIterator",
    "ChatTemplate",
    "Conversation",
    "DataError",
    "Example",
    "attach_template",
    "check_data_template",
    "check_settings",
    "RegenStats",
    "collate",
    "iter_json_array",
    "load_template",
    "load_conversations",
    "pin_date",
    "recorded_settings",
    "parse_record",
    "regenerate",
    "split_heldout",
    "split_turns",
    "token_counts",
    "tokenize_conversation",
]
