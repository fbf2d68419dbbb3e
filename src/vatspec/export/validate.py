"""Validation: an export folder checked against its format (exact keys, tensors, dtypes, vocabulary
maps, accept head) and, given a target, against that target."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from vatspec.drafters.vocab import check_draft_vocab
from vatspec.export.card import CARD
from vatspec.export.formats import (
    CONFIG,
    CONFIG_KEYS,
    HEAD_DIR,
    LLAMA_LAYER_KEYS,
    MASK_FILE,
    WEIGHTS,
    ExportError,
    detect_format,
    expected_weights,
    read_json,
    to_vllm_ids,
)
from vatspec.export.read import embedding_matches, load_accept_head, read_mask_embedding
from vatspec.export.record import RECORD
from vatspec.target import DTYPES


def validate_export(path: str | Path, target=None) -> str:
    """Check an export folder against its format; return the format or raise ``ExportError`` listing
    every problem: the exact config fields and their values, the exact tensor names, shapes and dtypes,
    the draft vocabulary maps, the accept head, and (with ``target``) the fit to the target."""
    path = Path(path)
    src = path / CONFIG
    cfg = read_json(src)
    fmt = detect_format(cfg, str(src))
    bad: list[str] = []
    _check_config(fmt, cfg, bad)
    extra_files = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    known = (CONFIG, WEIGHTS, HEAD_DIR, RECORD, CARD) + ((MASK_FILE,) if fmt == "dflash" else ())
    extra_files = [n for n in extra_files if n not in known]
    if extra_files:
        bad.append(f"unexpected files {extra_files} (an export holds {', '.join(known)})")
    if fmt == "dflash" and not bad:
        try:
            mask = read_mask_embedding(path)
        except ExportError as e:
            bad.append(str(e))
            mask = None
        if mask is not None:
            hid = cfg["hidden_size"]
            mid = cfg["dflash_config"]["mask_token_id"]
            if mask[1].numel() != hid:
                bad.append(f"{MASK_FILE}: a row of {mask[1].numel()}, expected hidden_size={hid}")
            if mask[0] != mid:  # SGLang reads only the dict form, with the id
                bad.append(f"{MASK_FILE}: mask_token_id {mask[0]} must be dflash_config.mask_token_id {mid}")
    if not bad:
        _check_weights(fmt, cfg, path / WEIGHTS, bad)
    if not bad and target is not None:
        _check_fit(fmt, cfg, path / WEIGHTS, target, bad)
    if (path / HEAD_DIR).exists():
        try:
            head, _ = load_accept_head(path)
            if head.proj.in_features != (cfg.get("transformer_layer_config") or cfg).get("hidden_size"):
                bad.append(f"{HEAD_DIR}: hidden_size {head.proj.in_features} differs from the draft's")
        except ExportError as e:
            bad.append(str(e))
    if bad:
        raise ExportError(f"{path}: not a valid {fmt} export:\n  - " + "\n  - ".join(bad))
    return fmt


def _check_config(fmt: str, cfg: dict, bad: list[str]) -> None:
    def want(ok: bool, msg: str) -> None:
        if not ok:
            bad.append(f"{CONFIG}: {msg}")

    def keys(d: Any, expected, where: str) -> bool:
        if not isinstance(d, dict):
            want(False, f"{where} must be an object")
            return False
        missing, extra = sorted(set(expected) - set(d)), sorted(set(d) - set(expected))
        want(not missing and not extra, f"{where}: missing {missing}, unexpected {extra}")
        return not missing

    if not keys(cfg, CONFIG_KEYS[fmt], "top level"):
        return
    lc = cfg["transformer_layer_config"] if fmt == "speculators" else cfg
    if fmt == "speculators" and not keys(lc, LLAMA_LAYER_KEYS, "transformer_layer_config"):
        return
    want(cfg["torch_dtype"] in DTYPES, f"torch_dtype {cfg['torch_dtype']!r} not in {sorted(DTYPES)}")
    want(lc["hidden_act"] == "silu", f"hidden_act {lc['hidden_act']!r}: the engines run SiLU only")
    want(lc["attention_bias"] is False and lc.get("mlp_bias", False) is False,
         "attention_bias / mlp_bias must be false")
    want(lc["tie_word_embeddings"] is False,
         "tie_word_embeddings must be false (SGLang would use the embedding as lm_head)")
    if fmt == "dflash":
        dc = cfg["dflash_config"]
        if keys(dc, {"mask_token_id", "target_layer_ids"} | ({"mask_token"} & set(dc or {})), "dflash_config"):
            ids = dc["target_layer_ids"]
            want(cfg["architectures"] == ["DFlashDraftModel"], f"architectures {cfg['architectures']}")
            nt = cfg["num_target_layers"]
            want(_int_list(ids) and len(ids) >= 1 and all(0 <= i < nt for i in ids),
                 f"dflash_config.target_layer_ids {ids} must be ids in [0, num_target_layers={nt})")
            want(_increasing(ids), f"dflash_config.target_layer_ids {ids} must be distinct and increasing (the "
                 "engines capture layers in the order they run)")
            want(_int_list(ids) and cfg["eagle_aux_hidden_state_layer_ids"] == to_vllm_ids(ids),
                 f"eagle_aux_hidden_state_layer_ids {cfg['eagle_aux_hidden_state_layer_ids']} must be "
                 f"dflash_config.target_layer_ids + 1 (vLLM counts the input of a layer)")
            want(isinstance(dc["mask_token_id"], int) and 0 <= dc["mask_token_id"] < cfg["vocab_size"],
                 f"dflash_config.mask_token_id {dc['mask_token_id']} outside [0, vocab_size={cfg['vocab_size']})")
        want(cfg["is_causal"] is False, "is_causal must be false (a DFlash block attends both ways)")
        want(isinstance(cfg["block_size"], int) and cfg["block_size"] >= 2, f"block_size {cfg['block_size']} < 2")
        return
    arch = ["LlamaForCausalLMEagle3"] if fmt == "eagle3-hf" else ["Eagle3Speculator"]
    want(cfg["architectures"] == arch, f"architectures {cfg['architectures']}, expected {arch}")
    want(lc["num_hidden_layers"] == 1 and lc["model_type"] == "llama", "an EAGLE-3 draft is one llama layer")
    want(cfg["norm_before_residual"] is False, "norm_before_residual must be false (residual on the pre-norm h)")
    dv = cfg["draft_vocab_size"]
    want(isinstance(dv, int) and isinstance(lc["vocab_size"], int) and 1 <= dv <= lc["vocab_size"],
         f"draft_vocab_size {dv} must be in [1, vocab_size={lc['vocab_size']}]")
    vllm = cfg["eagle_aux_hidden_state_layer_ids"]
    want(_int_list(vllm) and len(vllm) == 3 and min(vllm) >= 1,
         f"eagle_aux_hidden_state_layer_ids {vllm} must be 3 vLLM ids (input of layer j, so >= 1)")
    want(_increasing(vllm), f"eagle_aux_hidden_state_layer_ids {vllm} must be distinct and increasing (the engines "
         "capture layers in the order they run)")
    if fmt == "eagle3-hf" and keys(cfg["eagle_config"], {"use_aux_hidden_state", "eagle_aux_hidden_state_layer_ids"},
                                   "eagle_config"):
        ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        want(cfg["eagle_config"]["use_aux_hidden_state"] is True, "eagle_config.use_aux_hidden_state must be true")
        want(_int_list(ids) and to_vllm_ids(ids) == vllm, f"eagle_config.eagle_aux_hidden_state_layer_ids {ids} "
             f"(SGLang: output of layer i) must be eagle_aux_hidden_state_layer_ids {vllm} (vLLM: input) - 1")
    if fmt == "speculators":
        sc = cfg["speculators_config"]
        if keys(sc, {"algorithm", "proposal_methods", "default_proposal_method", "verifier"}, "speculators_config"):
            want(sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy",
                 "speculators_config: algorithm 'eagle3', default_proposal_method 'greedy'")
            pm = sc["proposal_methods"]
            if isinstance(pm, list) and len(pm) == 1 and keys(pm[0], {"proposal_type", "speculative_tokens",
                                                                      "verifier_accept_k", "accept_tolerance"},
                                                              "speculators_config.proposal_methods[0]"):
                want(pm[0]["proposal_type"] == "greedy" and isinstance(pm[0]["speculative_tokens"], int)
                     and pm[0]["speculative_tokens"] >= 1, f"proposal_methods[0] {pm[0]}")
            else:
                want(False, "speculators_config.proposal_methods must hold one greedy method")
            keys(sc["verifier"], {"name_or_path", "architectures"}, "speculators_config.verifier")


def _check_weights(fmt: str, cfg: dict, file: Path, bad: list[str]) -> None:
    if not file.is_file():
        bad.append(f"{WEIGHTS} is missing")
        return
    want = expected_weights(fmt, cfg)
    fdtype = DTYPES[cfg["torch_dtype"]]
    with safe_open(str(file), framework="pt") as f:
        have = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118 (a safetensors handle, not a dict)
        missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        if missing or extra:
            bad.append(f"{WEIGHTS}: missing {missing}, unexpected {extra}")
        for k in sorted(set(want) & set(have)):
            shape, dt = have[k]
            dt_want = {"d2t": "I64", "t2d": "BOOL"}.get(k, _ST_DTYPE[fdtype])
            if shape != want[k] or dt != dt_want:
                bad.append(f"{WEIGHTS}: {k} is {dt}{list(shape)}, expected {dt_want}{list(want[k])}")
        if fmt != "dflash" and not bad:
            try:
                check_draft_vocab(f.get_tensor("d2t"), f.get_tensor("t2d"))
            except ValueError as e:
                bad.append(f"{WEIGHTS}: d2t / t2d: {e}")


_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _check_fit(fmt: str, cfg: dict, file: Path, target, bad: list[str]) -> None:
    lc = cfg["transformer_layer_config"] if fmt == "speculators" else cfg
    ids = cfg["dflash_config"]["target_layer_ids"] if fmt == "dflash" else \
        [i - 1 for i in cfg["eagle_aux_hidden_state_layer_ids"]]
    checks = {"vocab_size": (lc["vocab_size"], target.vocab_size),
              "target_hidden_size": (cfg.get("target_hidden_size") or lc["hidden_size"], target.hidden_size),
              "hidden_size": (lc["hidden_size"], target.hidden_size)}
    if fmt == "dflash":
        checks["num_target_layers"] = (cfg["num_target_layers"], target.num_layers)
    for name, (have, want) in checks.items():
        if have != want:
            bad.append(f"{CONFIG}: {name}={have} does not match the target ({want})")
    if max(ids) >= target.num_layers:
        bad.append(f"{CONFIG}: layer ids {ids} (output of layer i) out of range for a {target.num_layers}-layer target")
    if fmt == "speculators":
        with safe_open(str(file), framework="pt") as f:
            emb = f.get_tensor("embed_tokens.weight")
        if not embedding_matches(emb, target):
            bad.append(f"{WEIGHTS}: embed_tokens.weight is not the target's input embedding")


def _increasing(x) -> bool:
    return _int_list(x) and all(a < b for a, b in zip(x, x[1:]))


def _int_list(x) -> bool:
    return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in x)

