"""DFlash's served format, ``dflash``, as z-lab's reference (``DFlashDraftModel``), SGLang and vLLM read it:

    config.json        a Qwen3-style layer config with ``architectures: [DFlashDraftModel]``, ``block_size``,
                       ``num_target_layers`` and ``dflash_config: {mask_token_id, target_layer_ids[, mask_token]}``
    model.safetensors  layers.i.*, fc, hidden_norm, norm (no embedding, no lm_head: the target's)
    mask_embedding.pt  only for a learned MASK row: ``{"mask_token_id": int, "embedding": [H]}``

Layer ids: ``dflash_config.target_layer_ids`` are the output of layer i (reference: ``hidden_states[i + 1]``; both
engines add 1), written as ours; vLLM's ``eagle_aux_hidden_state_layer_ids`` (ours + 1) too, so vLLM builds
without the DFlash fallback read the same layers.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from vatspec.drafters.dflash.config import MASK_TOKEN_STRING, DFlashConfig, default_target_layer_ids
from vatspec.drafters.layers import rope_parameters
from vatspec.drafters.served import (
    CONFIG,
    LLAMA_LAYER_KEYS,
    ConfigCheck,
    ExportError,
    Finding,
    ServedFormat,
    engine_layer_order,
    fit,
    increasing,
    int_list,
    layer_fields,
    to_vllm_ids,
)
from vatspec.target import DTYPES

MASK_FILE = "mask_embedding.pt"  # a learned MASK row, {"mask_token_id": int, "embedding": [H]}


class DFlashFormat(ServedFormat):
    name = "dflash"
    kind = "dflash"
    config_keys = (LLAMA_LAYER_KEYS - {"mlp_bias"}) | {
        "architectures", "torch_dtype", "is_causal", "block_size", "num_target_layers", "dflash_config",
        "eagle_aux_hidden_state_layer_ids",
    }
    architectures: ClassVar[list[str]] = ["DFlashDraftModel"]
    extra_files = (MASK_FILE,)
    tags = ("dflash",)
    vllm_method = "dflash"
    sglang_algorithm = "DFLASH"
    sglang_note = ("DFlash needs an attention backend with non-causal attention for the draft (see the engines' "
                   "documentation for the flags of their current versions).")

    # ------------------------------------------------------------------ a config.json
    def detect(self, cfg: dict) -> bool:
        return self.architectures[0] in (cfg.get("architectures") or [])

    def layer_ids(self, cfg: dict, num_layers: int) -> tuple[list[int], list[str]]:
        """``dflash_config.target_layer_ids``, else the reference's default for its draft depth."""
        vllm = cfg.get("eagle_aux_hidden_state_layer_ids")
        dc = cfg.get("dflash_config") or {}
        ids = dc.get("target_layer_ids", cfg.get("target_layer_ids"))
        if ids is None:
            nt = dc.get("num_target_layers", cfg.get("num_target_layers", num_layers))
            ids = default_target_layer_ids(nt, cfg.get("num_hidden_layers", 1))
        ids = [int(i) for i in ids]
        if vllm is not None and [int(i) for i in vllm] != to_vllm_ids(ids):
            return ids, [f"eagle_aux_hidden_state_layer_ids {vllm} (vLLM, input of layer j) is not "
                         f"dflash_config.target_layer_ids {ids} + 1; using dflash_config (the engines would read "
                         "different layers)"]
        return ids, []

    def sizes(self, cfg: dict, target) -> dict[str, tuple]:
        L = target.num_layers
        nt = (cfg.get("dflash_config") or {}).get("num_target_layers", cfg.get("num_target_layers", L))
        return {**super().sizes(cfg, target), "num_target_layers": (nt, L)}

    def served_k(self, cfg: dict) -> int | None:
        """block_size - 1: a block's first slot holds the last token committed."""
        return cfg["block_size"] - 1 if "block_size" in cfg else None

    # ------------------------------------------------------------------ export
    def build_config(self, drafter, target, dtype: str, *, k: int | None = None, verifier: str | None = None,
                     mask_token_id: int | None = None) -> dict:
        """``mask_token_id`` serves a learned MASK row (``served_mask_id``)."""
        c = drafter.config
        ids = sorted(int(i) for i in c.target_layer_ids)  # the engines capture layers in this order
        mask_id = served_mask_id(drafter, mask_token_id)
        mask = {"mask_token_id": mask_id, "target_layer_ids": ids}
        tok = getattr(target, "tokenizer", None)
        name = c.mask_token if mask_id == c.mask_token_id else (tok.convert_ids_to_tokens(mask_id) if tok else None)
        if name is not None:  # SGLang checks that the tokenizer maps this string to the id (default "<|MASK|>")
            mask["mask_token"] = name
        # the layer has q/k norms, a Qwen3 layer (the z-lab reference builds it from a Qwen3Config whatever the target)
        fields = layer_fields(c, model_type="qwen3", num_layers=c.num_layers, heads=c.num_attention_heads,
                              kv_heads=c.num_key_value_heads)
        del fields["mlp_bias"]
        return {"architectures": list(self.architectures), **fields, "torch_dtype": dtype, "is_causal": False,
                "block_size": c.block_size, "num_target_layers": c.num_target_layers, "dflash_config": mask,
                "eagle_aux_hidden_state_layer_ids": to_vllm_ids(ids)}

    def served_state(self, drafter, target) -> dict[str, Tensor]:
        state = super().served_state(drafter, target)
        state.pop("mask_embedding", None)  # served beside the weights: the engines read it from its own file
        return state

    def write_files(self, folder: Path, drafter, cfg: dict, dtype: str) -> None:
        if drafter.config.mask_source == "learned":  # the form both engines read: a dict, the row [H]
            torch.save({"mask_token_id": cfg["dflash_config"]["mask_token_id"],
                        "embedding": drafter.mask_embedding.detach().to(DTYPES[dtype]).cpu().contiguous()},
                       folder / MASK_FILE)

    # ------------------------------------------------------------------ validation
    def expected_weights(self, cfg: dict) -> dict[str, tuple[int, ...]]:
        H, I, nh = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
        nkv, hd = cfg.get("num_key_value_heads") or nh, cfg.get("head_dim") or H // nh
        Ht = cfg.get("target_hidden_size") or H
        n = len(cfg["dflash_config"]["target_layer_ids"])
        out = {"fc.weight": (H, n * Ht), "hidden_norm.weight": (H,), "norm.weight": (H,)}
        for i in range(cfg["num_hidden_layers"]):  # q/k/v read the layer's own width
            p = f"layers.{i}."
            out |= {f"{p}self_attn.q_proj.weight": (nh * hd, H), f"{p}self_attn.k_proj.weight": (nkv * hd, H),
                    f"{p}self_attn.v_proj.weight": (nkv * hd, H), f"{p}self_attn.o_proj.weight": (H, nh * hd),
                    f"{p}mlp.gate_proj.weight": (I, H), f"{p}mlp.up_proj.weight": (I, H),
                    f"{p}mlp.down_proj.weight": (H, I), f"{p}input_layernorm.weight": (H,),
                    f"{p}post_attention_layernorm.weight": (H,), f"{p}self_attn.q_norm.weight": (hd,),
                    f"{p}self_attn.k_norm.weight": (hd,)}
        return out

    def check_config(self, cfg: dict, check: ConfigCheck) -> None:
        want, dc = check.want, cfg["dflash_config"]
        if check.keys(dc, {"mask_token_id", "target_layer_ids"} | ({"mask_token"} & set(dc or {})), "dflash_config"):
            ids = dc["target_layer_ids"]
            want(cfg["architectures"] == self.architectures, f"architectures {cfg['architectures']}")
            nt = cfg["num_target_layers"]
            want(int_list(ids) and len(ids) >= 1 and all(0 <= i < nt for i in ids),
                 f"dflash_config.target_layer_ids {ids} must be ids in [0, num_target_layers={nt})")
            want(increasing(ids), f"dflash_config.target_layer_ids {ids} must be distinct and increasing (the "
                 "engines capture layers in the order they run)")
            want(int_list(ids) and cfg["eagle_aux_hidden_state_layer_ids"] == to_vllm_ids(ids),
                 f"eagle_aux_hidden_state_layer_ids {cfg['eagle_aux_hidden_state_layer_ids']} must be "
                 f"dflash_config.target_layer_ids + 1 (vLLM counts the input of a layer)")
            want(isinstance(dc["mask_token_id"], int) and 0 <= dc["mask_token_id"] < cfg["vocab_size"],
                 f"dflash_config.mask_token_id {dc['mask_token_id']} outside [0, vocab_size={cfg['vocab_size']})")
        want(cfg["is_causal"] is False, "is_causal must be false (a DFlash block attends both ways)")
        want(isinstance(cfg["block_size"], int) and cfg["block_size"] >= 2, f"block_size {cfg['block_size']} < 2")

    def check_files(self, folder: Path, cfg: dict, bad: list[str]) -> None:
        try:
            mask = read_mask_embedding(folder)
        except ExportError as e:
            bad.append(str(e))
            return
        if mask is not None:
            hid = cfg["hidden_size"]
            mid = cfg["dflash_config"]["mask_token_id"]
            if mask[1].numel() != hid:
                bad.append(f"{MASK_FILE}: a row of {mask[1].numel()}, expected hidden_size={hid}")
            if mask[0] != mid:  # SGLang reads only the dict form, with the id
                bad.append(f"{MASK_FILE}: mask_token_id {mask[0]} must be dflash_config.mask_token_id {mid}")

    # ------------------------------------------------------------------ import
    def read(self, folder: Path, cfg: dict, weights: dict[str, Tensor], target, *,
             k: int | None = None) -> tuple[DFlashConfig, dict[str, Tensor]]:
        """A DFlash draft's k is its block_size - 1 (``k`` is not read); its learned MASK row, ``mask_embedding.pt``."""
        mask_row = read_mask_embedding(folder)
        if mask_row is not None:
            weights = {**weights, "mask_embedding": mask_row[1]}
        return _read_config(cfg, target, str(folder / CONFIG), mask_row[0] if mask_row else None), weights

    # ------------------------------------------------------------------ the model card
    def card_rows(self, cfg: dict, k: int) -> list[tuple[str, Any]]:
        mask = cfg["dflash_config"]
        name = f" (`{mask['mask_token']}`)" if "mask_token" in mask else ""
        return [("block size", cfg["block_size"]), ("tokens drafted a round (block size - 1)", k),
                ("draft vocabulary", f"the target's ({cfg['vocab_size']})"),
                ("MASK token id", f"{mask['mask_token_id']}{name}")]

    def sglang_flags(self, k: int) -> str:
        return f"--speculative-num-draft-tokens {k + 1}"

    # ------------------------------------------------------------------ vatspec check
    def findings(self, cfg: dict, folder: Path, target) -> list[Finding]:
        """The MASK token: an id of the vocabulary, not an end-of-turn token, the one its string names."""
        dc = cfg.get("dflash_config") or {}
        mask_id, mask = dc.get("mask_token_id", cfg.get("mask_token_id")), dc.get("mask_token")
        tok = target.tokenizer
        if mask_id is None:
            vocab = tok.get_vocab() if tok is not None and hasattr(tok, "get_vocab") else {}
            mask_id = vocab.get(mask or MASK_TOKEN_STRING)
            if mask_id is None:
                return [Finding(False, "mask token", f"no mask_token_id and the tokenizer has no "
                                f"{mask or MASK_TOKEN_STRING!r}")]
        if not (isinstance(mask_id, int) and 0 <= mask_id < target.vocab_size):
            return [Finding(False, "mask token", f"mask_token_id {mask_id} outside the vocabulary "
                            f"[0, {target.vocab_size})")]
        if mask_id in target.eos_token_ids:
            return [Finding(False, "mask token", f"mask_token_id {mask_id} is an end-of-turn token of the target")]
        name = tok.convert_ids_to_tokens(mask_id) if tok is not None else None
        if mask is not None and name is not None and name != mask:
            return [Finding(False, "mask token", f"mask_token {mask!r} but id {mask_id} is {name!r} in the target's "
                            "tokenizer (SGLang looks the string up, vLLM and the reference use the id)")]
        learned = (folder / MASK_FILE).is_file()
        return [Finding(True, "mask token", f"id {mask_id}" + (f" ({name!r})" if name else "") + (
            f"; a learned row in {MASK_FILE} (vLLM puts it in the draft's lookup of the id, SGLang in the target's "
            "embedding row; z-lab's reference ignores it)" if learned else ", embedded with the target's row"))]


def served_mask_id(drafter, mask_token_id: int | None) -> int:
    """The MASK id a DFlash export writes. A draft that learned its own MASK row trained it as an id past the
    vocabulary (``vocab_size``); both engines take a learned row from ``mask_embedding.pt`` only for an id inside
    it, so serving needs ``mask_token_id``: a target id that never occurs in the text drafted (vLLM swaps the row
    into the draft's own lookup of that id; SGLang writes it into the target's embedding row of that id)."""
    c = drafter.config
    if mask_token_id is None:
        if c.mask_source == "learned" and c.mask_token_id >= c.vocab_size:
            raise ExportError("this DFlash draft learned its own MASK row as an id past the vocabulary; the engines "
                              "serve a learned row (mask_embedding.pt) for a target id: pass --mask-token-id ID, an "
                              "id the target never emits")
        return int(c.mask_token_id)
    if c.mask_source != "learned" and mask_token_id != c.mask_token_id:
        raise ExportError(f"--mask-token-id {mask_token_id}: this draft was trained with MASK id {c.mask_token_id} "
                          "(the target's embedding row); only a learned MASK row can be served under another id")
    if not 0 <= mask_token_id < c.vocab_size:
        raise ExportError(f"--mask-token-id {mask_token_id} outside the target vocabulary [0, {c.vocab_size})")
    return int(mask_token_id)


def read_mask_embedding(path: Path) -> tuple[int | None, Tensor] | None:
    """A DFlash folder's learned MASK row, as the engines read ``mask_embedding.pt`` (no code runs:
    ``weights_only``) -> ``(its mask_token_id | None, row [H])``, or None without the file."""
    file = Path(path) / MASK_FILE
    if not file.is_file():
        return None
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, pickle.UnpicklingError) as e:
        raise ExportError(f"{file}: unreadable ({e})") from e
    mask_id, row = (obj.get("mask_token_id"), obj.get("embedding")) if isinstance(obj, dict) else (None, obj)
    if not isinstance(row, Tensor) or not row.is_floating_point() or row.dim() not in (1, 2) \
            or (row.dim() == 2 and row.shape[0] != 1):
        raise ExportError(f"{file}: expected a float tensor [H] (or a dict with one under 'embedding')")
    if mask_id is not None and not isinstance(mask_id, int):
        raise ExportError(f"{file}: mask_token_id {mask_id!r} is not an integer")
    return mask_id, row.reshape(-1).float()


def _read_config(cfg: dict, target, src: str, learned_id: int | None = None) -> DFlashConfig:
    dc = cfg.get("dflash_config") or {}
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers"):
        if name not in cfg:
            raise ExportError(f"{src}: {name} is missing")
    types = set(cfg.get("layer_types") or ["full_attention"])
    if types != {"full_attention"} or cfg.get("is_causal") or dc.get("causal") or cfg.get("use_sliding_window") \
            or cfg.get("attention_bias") or dc.get("use_swa"):
        raise ExportError(f"{src}: causal / sliding-window / biased DFlash layers are a variant vatspec's drafter does "
                          "not implement (full non-causal attention, no biases)")
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    NT = dc.get("num_target_layers", cfg.get("num_target_layers", target.num_layers))
    fit(src, "num_target_layers", NT, target.num_layers)
    fit(src, "vocab_size", cfg.get("vocab_size", target.vocab_size), target.vocab_size)
    fit(src, "target_hidden_size", cfg.get("target_hidden_size") or H, target.hidden_size)
    fit(src, "hidden_size (the draft shares the target's embedding and lm_head)", H, target.hidden_size)
    ids, problems = DFLASH.layer_ids(cfg, target.num_layers)
    for problem in problems:
        warnings.warn(f"{src}: {problem}", stacklevel=4)
    mask_id, mask = dc.get("mask_token_id", cfg.get("mask_token_id")), dc.get("mask_token")
    if mask_id is None:  # as SGLang: look the mask string up in the target's vocabulary
        vocab = target.tokenizer.get_vocab() if target.tokenizer is not None else {}
        mask = mask or MASK_TOKEN_STRING
        mask_id = vocab.get(mask)
        if mask_id is None:
            raise ExportError(f"{src}: dflash_config.mask_token_id is missing and the target's tokenizer "
                              f"has no {mask!r}")
    learned = (Path(src).parent / MASK_FILE).is_file()
    if learned and learned_id is not None and learned_id != mask_id:
        raise ExportError(f"{src}: {MASK_FILE} is for mask_token_id {learned_id}, dflash_config says {mask_id}")
    nh = cfg["num_attention_heads"]
    theta, scaling = rope_parameters(cfg)
    try:
        return DFlashConfig(
            target_layer_ids=tuple(engine_layer_order(ids, src)), num_target_layers=NT,
            target_hidden_size=cfg.get("target_hidden_size") or H,
            vocab_size=target.vocab_size, hidden_size=H, num_attention_heads=nh,
            num_key_value_heads=cfg.get("num_key_value_heads") or nh, head_dim=cfg.get("head_dim") or H // nh,
            intermediate_size=cfg["intermediate_size"], mask_token_id=int(mask_id),
            mask_source="learned" if learned else "override",
            mask_token=mask, num_layers=L, block_size=int(dc.get("block_size", cfg.get("block_size", 16))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            target_model_type=str(getattr(target.config, "model_type", "qwen3")),
        )
    except ValueError as e:
        raise ExportError(f"{src}: {e}") from e


DFLASH = DFlashFormat()
