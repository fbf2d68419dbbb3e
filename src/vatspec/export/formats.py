"""The served formats by name, which one a config.json is, and the files every export folder holds beside the
format's own (see ``vatspec.export``; each format is its drafter's, ``vatspec.drafters.served.ServedFormat``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from vatspec.drafters import DRAFTERS, SERVED_FORMATS, RegistryView
from vatspec.drafters.served import CONFIG, WEIGHTS, ExportError, ServedFormat, to_vllm_ids

__all__ = ["CONFIG", "CONFIG_KEYS", "FORMATS", "HEAD_DIR", "HEAD_FORMAT", "HEAD_INPUT", "WEIGHTS", "ExportError",
           "default_format", "read_json", "served_format", "to_vllm_ids"]

# format -> its drafter kind, and format -> the fields its config.json holds (exactly these: validate_export
# checks), over the kinds in DRAFTERS when read
FORMATS: Mapping[str, str] = RegistryView(lambda: {name: f.kind for name, f in SERVED_FORMATS.items()})
CONFIG_KEYS: Mapping[str, frozenset[str]] = RegistryView(
    lambda: {name: f.config_keys for name, f in SERVED_FORMATS.items()})
HEAD_DIR = "accept_head"
HEAD_FORMAT = "vatspec-accept-head"
HEAD_INPUT = "draft_hidden_post_norm"  # the drafter's last hidden state after its final norm (lm_head's input)


def served_format(name: str) -> ServedFormat:
    """The format called ``name`` (``--format``)."""
    if name not in SERVED_FORMATS:
        raise ExportError(f"unknown format {name!r} (known: {', '.join(SERVED_FORMATS)})")
    return SERVED_FORMATS[name]


def default_format(drafter) -> str:
    """The format ``drafter`` is exported in unless told: the first its class serves (``Drafter.formats``)."""
    if not drafter.formats:
        raise ExportError(f"{drafter.title} drafters ({drafter.kind}) have no served format: vatspec cannot export one")
    return drafter.formats[0].name


def detect(cfg: dict, source: str) -> ServedFormat:
    """The format of a config.json, from its contents."""
    for fmt in SERVED_FORMATS.values():
        try:
            if fmt.detect(cfg):
                return fmt
        except ExportError as e:  # a variant of the format that is not supported
            raise ExportError(f"{source}: {e}") from None
    archs = cfg.get("architectures") or []
    raise ExportError(f"{source}: architectures {archs} is none of the drafts vatspec reads: "
                      + "; ".join(f"{cls.title} ({', '.join(f.architectures[0] for f in cls.formats)})"
                                  for cls in DRAFTERS.values()))


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise ExportError(f"{path} is missing")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ExportError(f"{path}: expected a JSON object")
    return data
