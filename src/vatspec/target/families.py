"""What differs between model families, found from what a config and a checkpoint say, never from a list of
model names the code was written for: how the model turns its last hidden state into logits (``LOGIT_RULES``),
and under which key a checkpoint keeps a tensor (``read_checkpoint_tensors``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from safetensors import safe_open
from torch import Tensor

__all__ = ["LOGIT_RULES", "LogitRule", "logit_transform", "read_checkpoint_tensors"]


class LogitRule(NamedTuple):
    """How a family's forward turns ``lm_head(hidden)`` into its logits: ``softcap(x * scale)``, the config
    fields named here; a field the config leaves unset (None) does nothing."""

    scale: str | None = None  # the field the logits are multiplied by
    divide: bool = False  # divided by, instead
    softcap: str = "final_logit_softcapping"  # then ``c * tanh(x / c)``, c this field


# Every transform a ``*ForCausalLM.forward`` of transformers (5.25) applies after its lm_head, by the text config's
# model_type; any other family: ``LogitRule()`` (Gemma 2/3/3n/4, VaultGemma, NanoChat soft-cap). By family, not by
# field: one name means two things (Granite divides by logits_scaling, HyperCLOVAX multiplies).
LOGIT_RULES: dict[str, LogitRule] = {
    "falcon_h1": LogitRule("lm_head_multiplier"),
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe", "cohere_compass_text"), LogitRule("logit_scale")),
    **dict.fromkeys(("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared",
                     "minicpm3"), LogitRule("logits_scaling", divide=True)),  # MiniCPM3 divides the hidden state
    "hyperclovax": LogitRule("logits_scaling"),
    "recurrent_gemma": LogitRule(softcap="logits_soft_cap"),
    "xlstm": LogitRule(softcap="output_logit_soft_cap"),
}


def logit_transform(config) -> tuple[float, float | None]:
    """``(scale, softcap | None)``: the model of ``config`` (its text config) computes its logits as
    ``softcap(lm_head(hidden) * scale)`` (``LOGIT_RULES``)."""
    rule = LOGIT_RULES.get(getattr(config, "model_type", None), LogitRule())
    value = getattr(config, rule.scale, None) if rule.scale else None
    scale = 1.0 if value is None else (1.0 / float(value) if rule.divide else float(value))
    return scale, float(getattr(config, rule.softcap, None) or 0) or None


def read_checkpoint_tensors(model, folder: Path, names: Sequence[str]) -> dict[str, Tensor]:
    """The parameters ``names`` of ``model`` (built from the folder's config, weights on ``meta`` or not) read
    from the folder's safetensors files, by the key the checkpoint holds each under: the name itself; else the
    key transformers renames to it when it loads the folder (its checkpoint conversion mapping: Nemotron-H's
    ``backbone.embeddings.weight`` is the module's ``model.embeddings.weight``, Qwen3.5's
    ``model.language_model.embed_tokens.weight`` its text model's ``model.embed_tokens.weight``); else the one
    key ending in the name's leaf (``embeddings.weight``) whose tensor has the parameter's shape.
    A name found nowhere is left out; only the tensors found are read."""
    where: dict[str, Path] = {}  # checkpoint key -> its file (headers only)
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), file))  # noqa: SIM118 (a safetensors handle, not a dict)
    params = dict(model.named_parameters(remove_duplicate=False))
    renamed = _renamed_by_transformers(model, where)
    keys = {}
    for name in names:
        if name in where:
            keys[name] = name
        elif name in renamed:
            keys[name] = renamed[name]
        else:
            leaf = ".".join(name.split(".")[-2:])
            like = [k for k in where if (k == leaf or k.endswith("." + leaf))
                    and _saved_shape(where[k], k) == tuple(params[name].shape)]
            if len(like) == 1:
                keys[name] = like[0]
    out = {}
    for name, key in keys.items():
        with safe_open(str(where[key]), framework="pt") as f:
            out[name] = f.get_tensor(key)
    return out


def _renamed_by_transformers(model, keys) -> dict[str, str]:
    """Model parameter name -> the checkpoint key transformers loads into it, for the keys it renames (transformers
    5's conversion mapping of the model's class); {} where it renames none, or in a transformers without the mapping
    (4.x names checkpoints as its modules)."""
    state = model.state_dict()  # names and shapes (meta tensors where the weights are)
    out = {}
    try:  # transformers' loading internals: if they move, the leaf-name match of the caller still finds the tensors
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        mapping = get_model_conversion_mapping(model)
        renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        for key in keys:
            name, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
            if name != key and name in state:
                out.setdefault(name, key)
    except (ImportError, AttributeError, TypeError):
        return {}
    return out


def _saved_shape(file: Path, key: str) -> tuple[int, ...]:
    with safe_open(str(file), framework="pt") as f:
        return tuple(f.get_slice(key).get_shape())
