"""A served draft format (``ServedFormat``: each drafter kind lists its own in ``Drafter.formats``) and what the
formats share: their error, the decoder-layer fields the engines read, the engines' layer-id conventions.

``vatspec.export`` writes, reads and validates the folders (``config.json``, ``model.safetensors``, the record,
the model card, the accept head, atomic writes) and asks the folder's format for all that differs between formats;
``vatspec check`` asks it for the conventions it checks. Layer ids: ours are the output of layer i (``vatspec.target``);
vLLM's ``eagle_aux_hidden_state_layer_ids`` count the input of layer j, ours + 1 (``to_vllm_ids``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from vatspec.drafters.errors import CheckpointError
from vatspec.drafters.layers import rope_parameters

CONFIG, WEIGHTS = "config.json", "model.safetensors"  # what the engines read from every served folder


class ExportError(CheckpointError):
    """A draft cannot be exported, an export is invalid, or an imported draft does not fit the target."""


# The decoder-layer fields both engines build a draft layer from (a LlamaConfig / Qwen3Config subset).
LLAMA_LAYER_KEYS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_theta",
    "rope_scaling", "attention_bias", "mlp_bias", "tie_word_embeddings",
})


def layer_fields(c, *, model_type: str, num_layers: int, heads: int, kv_heads: int) -> dict:
    """The ``LLAMA_LAYER_KEYS`` of a drafter config ``c``, in the order the exports write them."""
    return {
        "model_type": model_type,
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": c.head_dim, "hidden_act": getattr(c, "hidden_act", "silu"), "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings, "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    }


def to_vllm_ids(ids) -> list[int]:
    """Our ids (output of layer i) -> vLLM's ``eagle_aux_hidden_state_layer_ids`` (input of layer j)."""
    return [int(i) + 1 for i in ids]


def engine_layer_order(ids: list[int], src: str) -> list[int]:
    """The ids as the engines use them: they capture the target's layers in the order those run, so
    ``fc`` reads the features in increasing layer order whatever order the config lists."""
    if ids != sorted(ids):
        warnings.warn(f"{src}: layer ids {ids} are not in increasing order; the engines feed fc the layers in "
                      f"the order they run ({sorted(ids)}), and so does this import", stacklevel=4)
    return sorted(ids)


def fit(src: str, name: str, have, want) -> None:
    """An ``ExportError`` naming ``name`` when a served draft's ``have`` is not the target's ``want``."""
    if have != want:
        raise ExportError(f"{src}: {name}={have} does not match the target ({want})")


EMBEDDING_ATOL = 1e-2  # a bfloat16 copy of the target's embedding rounds by far less


def embedding_matches(emb: Tensor, target) -> bool:
    """Whether a served ``embed_tokens.weight`` is the target's input embedding (up to dtype rounding)."""
    want = target.input_embedding()
    return emb.shape == want.shape and bool(torch.allclose(emb.float(), want.float(), atol=EMBEDDING_ATOL))


def int_list(x) -> bool:
    """A JSON list of non-negative ints (not bools)."""
    return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in x)


def increasing(x) -> bool:
    return int_list(x) and all(a < b for a, b in zip(x, x[1:]))


@dataclass
class Finding:
    """One convention ``vatspec check`` checked on a served folder."""

    ok: bool
    what: str  # the convention checked, e.g. "layer ids"
    detail: str  # what was found; names the field or tensor


class ConfigCheck:
    """The problems of a ``config.json``, one line each (``validate_export`` lists them all)."""

    def __init__(self, bad: list[str], file: str):
        self.bad, self.file = bad, file

    def want(self, ok: bool, msg: str) -> None:
        if not ok:
            self.bad.append(f"{self.file}: {msg}")

    def keys(self, d: Any, expected, where: str) -> bool:
        """``d`` is an object with exactly the ``expected`` keys; False when it is none or misses one."""
        if not isinstance(d, dict):
            self.want(False, f"{where} must be an object")
            return False
        missing, extra = sorted(set(expected) - set(d)), sorted(set(d) - set(expected))
        self.want(not missing and not extra, f"{where}: missing {missing}, unexpected {extra}")
        return not missing


class ServedFormat:
    """One layout a drafter kind is served in: its ``config.json`` and tensors as the engines read them.

    ``vatspec.export`` and ``vatspec check`` call these on the format of a folder (``detect``) or the one asked
    for; the defaults are what a format with a top-level Llama-style layer config and the drafter's own tensor
    names does. ``cfg`` is a ``config.json`` as a dict; ``bad`` a list of problems to append to."""

    name: str  # --format, e.g. "eagle3-hf"
    kind: str  # the drafter kind it serves
    config_keys: frozenset[str]  # config.json holds exactly these
    architectures: ClassVar[list[str]]  # what config.json names (the engines pick their loader by it)
    layer_key: str | None = None  # the field holding the decoder layer's fields; None: the top level
    extra_files: tuple[str, ...] = ()  # files an export holds beside config.json, the weights and vatspec's own
    tensor_dtypes: ClassVar[dict[str, str]] = {}  # safetensors dtypes of the tensors not in torch_dtype
    # what the model card (``vatspec.export.card``) says of the format and how the engines launch it
    tags: tuple[str, ...] = ()  # the hub tags naming the kind and format, beside the card's own
    vllm_method: str  # the "method" of vLLM's --speculative-config
    vllm_alone = False  # vLLM serves the folder alone (`vllm serve DIR`): it names the target and k
    sglang_algorithm: str | None = None  # SGLang's --speculative-algorithm; None: SGLang does not load the format
    sglang_note = ""  # a line the card adds below the SGLang command

    # ------------------------------------------------------------------ a config.json
    def detect(self, cfg: dict) -> bool:
        """Whether ``cfg`` is this format's (an ``ExportError`` for a variant of it that is not supported)."""
        raise NotImplementedError

    def layer_config(self, cfg: dict) -> dict:
        """The decoder layer's fields ({} when they are not an object)."""
        lc = cfg.get(self.layer_key) if self.layer_key else cfg
        return lc if isinstance(lc, dict) else {}

    def layer_ids(self, cfg: dict, num_layers: int) -> tuple[list[int], list[str]]:
        """The target layers (ours: output of layer i) the engines capture for ``cfg``, in the order it lists
        them, and the disagreements between its fields."""
        raise NotImplementedError

    def sizes(self, cfg: dict, target) -> dict[str, tuple[Any, Any]]:
        """Each size the draft shares with ``target``: name -> (the config's, the target's)."""
        lc = self.layer_config(cfg)
        return {"vocab_size": (lc.get("vocab_size"), target.vocab_size),
                "hidden_size": (lc.get("hidden_size"), target.hidden_size),
                "target_hidden_size": (cfg.get("target_hidden_size") or lc.get("hidden_size"), target.hidden_size)}

    def target_rope(self, target_config) -> tuple[float, dict | None]:
        """The RoPE the draft must rotate with for a target of ``target_config`` (by default the target's)."""
        return rope_parameters(target_config)

    def served_k(self, cfg: dict) -> int | None:
        """The tokens drafted a round that ``cfg`` records; None where it records none (a training setting)."""
        return None

    def named_target(self, cfg: dict) -> str | None:
        """The target ``cfg`` names (the model an engine loads with the draft); None where it names none."""
        return None

    # ------------------------------------------------------------------ export
    def check_exportable(self, drafter) -> None:
        """An ``ExportError`` when the engines cannot serve ``drafter`` in this format."""

    def build_config(self, drafter, target, dtype: str, *, k: int | None = None, verifier: str | None = None,
                     mask_token_id: int | None = None) -> dict:
        """The config.json of ``drafter``. Options a format without them ignores: ``k`` tokens drafted per round,
        written as ``speculative_tokens`` (speculators; default ``drafter.k``, the TTT steps); ``verifier``, the
        target name vLLM loads when serving the draft folder alone (speculators; default the target's path);
        ``mask_token_id``, the target id a learned MASK row is served for (dflash)."""
        raise NotImplementedError

    def served_state(self, drafter, target) -> dict[str, Tensor]:
        """The drafter's tensors under their served names, in the drafter's dtype. ``fc``'s input blocks in
        increasing layer order: both engines capture the target's layers in the order they run, whatever order
        the config lists them in, so a drafter trained on ids (26, 1, 14) has its columns permuted to (1, 14, 26)."""
        state = dict(drafter.state_dict())
        ids = [int(i) for i in drafter.config.target_layer_ids]
        order = sorted(range(len(ids)), key=ids.__getitem__)
        if order != list(range(len(ids))):
            blocks = state["fc.weight"].chunk(len(ids), dim=1)  # [H, Ht] each, in the drafter's order
            state["fc.weight"] = torch.cat([blocks[j] for j in order], dim=1)
        return state

    def write_files(self, folder: Path, drafter, cfg: dict, dtype: str) -> None:
        """Write the format's ``extra_files`` for ``drafter`` into ``folder``."""

    # ------------------------------------------------------------------ validation
    def expected_weights(self, cfg: dict) -> dict[str, tuple[int, ...]]:
        """Every tensor of an export and its shape, from the sizes in its config.json."""
        raise NotImplementedError

    def check_config(self, cfg: dict, check: ConfigCheck) -> None:
        """The format's own fields of a config.json whose keys are the format's."""

    def check_files(self, folder: Path, cfg: dict, bad: list[str]) -> None:
        """The format's ``extra_files`` in an export folder."""

    def check_weights(self, tensor, bad: list[str]) -> None:
        """The format's own checks of the weights (``tensor(name)`` reads one), once names and shapes are right."""

    def check_fit(self, cfg: dict, weights: Path, target, bad: list[str]) -> None:
        """The format's own checks against ``target``, beyond ``sizes`` and the layer ids."""

    # ------------------------------------------------------------------ import
    def internal_name(self, name: str) -> str:
        """A served tensor name -> the drafter's ``state_dict`` name."""
        return name

    def read(self, folder: Path, cfg: dict, weights: dict[str, Tensor], target, *,
             k: int | None = None) -> tuple[Any, dict[str, Tensor]]:
        """A served folder -> (the drafter's config, its ``state_dict``). ``cfg`` is the folder's config.json and
        ``weights`` its tensors, already under internal names (``internal_name``); the ``state_dict`` is
        ``weights`` with what the format adds (an EAGLE-3 draft's identity d2t / t2d, a DFlash draft's learned
        MASK row). ``k``: the drafted length, where it is a setting. ``ExportError`` naming the field at fault
        when the draft does not fit ``target`` or is a variant vatspec's drafter does not implement."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the model card
    def card_rows(self, cfg: dict, k: int) -> list[tuple[str, Any]]:
        """The format's own rows of the card's drafter table (name, value), after the rows every format shares;
        ``k`` the tokens drafted a round."""
        return []

    def sglang_flags(self, k: int) -> str:
        """SGLang's flags for drafting ``k`` tokens a round, beside the algorithm and the draft's path."""
        return ""

    # ------------------------------------------------------------------ vatspec check
    def weight_findings(self, cfg: dict, tensors: dict[str, Tensor], target) -> list[Finding]:
        """The format's conventions on the weights read (every tensor of the folder's ``*.safetensors``)."""
        return []

    def findings(self, cfg: dict, folder: Path, target) -> list[Finding]:
        """The format's other conventions (a DFlash draft's MASK token)."""
        return []
