"""Served draft formats: export to SGLang / vLLM / speculators, import back, validate on the way.

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

Import (``import_draft``, ``load_any_draft``) reads the three formats, including third-party drafts
(bf16, ``pytorch_model.bin``, an ``embed_tokens.weight`` equal to the target's), into this
project's drafter classes, and fails with the field at fault when the draft does not fit the target.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from vatspec.checkpoint import CheckpointError, load_draft, resolve_checkpoint
from vatspec.drafters.base import AcceptHead
from vatspec.drafters.dflash import DFlashConfig, DFlashDrafter, default_target_layer_ids
from vatspec.drafters.eagle3 import Eagle3Config, Eagle3Drafter, default_layer_ids
from vatspec.drafters.vocab import check_draft_vocab

FORMATS: dict[str, str] = {"eagle3-hf": "eagle3", "speculators": "eagle3", "dflash": "dflash"}  # -> drafter kind
DEFAULT_FORMAT = {"eagle3": "eagle3-hf", "dflash": "dflash"}
CONFIG, WEIGHTS, HEAD_DIR = "config.json", "model.safetensors", "accept_head"
HEAD_FORMAT = "vatspec-accept-head"
HEAD_INPUT = "draft_hidden_post_norm"  # the drafter's last hidden state after its final norm (lm_head's input)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")

# The fields each format's config.json holds: exactly these, no more (validate_export checks).
LLAMA_LAYER_KEYS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_theta",
    "rope_scaling", "attention_bias", "mlp_bias", "tie_word_embeddings",
})
CONFIG_KEYS: dict[str, frozenset[str]] = {
    "eagle3-hf": LLAMA_LAYER_KEYS | {
        "architectures", "torch_dtype", "draft_vocab_size", "target_hidden_size", "norm_before_residual",
        "eagle_config", "eagle_aux_hidden_state_layer_ids",
    },
    "speculators": frozenset({
        "speculators_model_type", "architectures", "torch_dtype", "transformer_layer_config", "draft_vocab_size",
        "norm_before_residual", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "speculators_config",
    }),
    "dflash": (LLAMA_LAYER_KEYS - {"mlp_bias"}) | {
        "architectures", "torch_dtype", "is_causal", "block_size", "num_target_layers", "dflash_config",
        "eagle_aux_hidden_state_layer_ids",
    },
}


class ExportError(CheckpointError):
    """A draft cannot be exported, an export is invalid, or an imported draft does not fit the target."""


def to_vllm_ids(ids) -> list[int]:
    """Our ids (output of layer i) -> vLLM's ``eagle_aux_hidden_state_layer_ids`` (input of layer j)."""
    return [int(i) + 1 for i in ids]


# ----------------------------------------------------------------------------- config.json
def _layer_fields(c: Eagle3Config | DFlashConfig, num_layers: int) -> dict:
    """The decoder-layer fields both engines read (a LlamaConfig / Qwen3Config subset)."""
    heads = c.num_heads if isinstance(c, Eagle3Config) else c.num_attention_heads
    kv = c.num_kv_heads if isinstance(c, Eagle3Config) else c.num_key_value_heads
    return {
        "model_type": "llama" if isinstance(c, Eagle3Config) else c.target_model_type,
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": c.head_dim, "hidden_act": getattr(c, "hidden_act", "silu"), "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings, "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    }


def build_config(fmt: str, drafter, target, dtype: str, *, speculative_tokens: int | None = None,
                 verifier: str | None = None) -> dict:
    """The config.json of ``drafter`` in format ``fmt`` (see the module docstring for the ids).

    speculators only: ``speculative_tokens`` per round (default: the TTT steps) and ``verifier``, the
    target name vLLM loads when serving the draft folder alone (default: the target's path)."""
    c = drafter.config
    ids = [int(i) for i in c.target_layer_ids]
    if fmt == "dflash":
        mask = {"mask_token_id": c.mask_token_id, "target_layer_ids": ids}
        if c.mask_token is not None:  # SGLang reads the string too (default "<|MASK|>")
            mask["mask_token"] = c.mask_token
        fields = _layer_fields(c, c.num_layers)
        del fields["mlp_bias"]
        return {"architectures": ["DFlashDraftModel"], **fields, "torch_dtype": dtype, "is_causal": False,
                "block_size": c.block_size, "num_target_layers": c.num_target_layers, "dflash_config": mask,
                "eagle_aux_hidden_state_layer_ids": to_vllm_ids(ids)}
    eagle = {"draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size,
             "norm_before_residual": False}  # the residual is the pre-norm h (vLLM's speculators default is True)
    if fmt == "eagle3-hf":
        return {"architectures": ["LlamaForCausalLMEagle3"], **_layer_fields(c, 1), "torch_dtype": dtype, **eagle,
                "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": ids},
                "eagle_aux_hidden_state_layer_ids": to_vllm_ids(ids)}
    cfg = getattr(target.model, "config", None)
    proposal = {"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens or c.ttt_steps),
                "verifier_accept_k": 1, "accept_tolerance": 0.0}
    verifier = {"name_or_path": verifier or target.path or getattr(cfg, "_name_or_path", None) or None,
                "architectures": list(getattr(cfg, "architectures", None) or [])}
    return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "torch_dtype": dtype,
            "transformer_layer_config": _layer_fields(c, 1), **eagle,
            "eagle_aux_hidden_state_layer_ids": to_vllm_ids(ids),
            "speculators_config": {"algorithm": "eagle3", "proposal_methods": [proposal],
                                   "default_proposal_method": "greedy", "verifier": verifier}}


def expected_weights(fmt: str, cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a ``fmt`` export and its shape, from the sizes in its config.json."""
    lc = cfg["transformer_layer_config"] if fmt == "speculators" else cfg
    H, I, nh = lc["hidden_size"], lc["intermediate_size"], lc["num_attention_heads"]
    nkv, hd = lc.get("num_key_value_heads") or nh, lc.get("head_dim") or H // nh
    Ht = cfg.get("target_hidden_size") or H
    attn_in = H if fmt == "dflash" else 2 * H  # EAGLE-3's q/k/v read cat(embedding, hidden)

    def layer(p: str) -> dict[str, tuple[int, ...]]:
        w = {f"{p}self_attn.q_proj.weight": (nh * hd, attn_in), f"{p}self_attn.k_proj.weight": (nkv * hd, attn_in),
             f"{p}self_attn.v_proj.weight": (nkv * hd, attn_in), f"{p}self_attn.o_proj.weight": (H, nh * hd),
             f"{p}mlp.gate_proj.weight": (I, H), f"{p}mlp.up_proj.weight": (I, H), f"{p}mlp.down_proj.weight": (H, I),
             f"{p}input_layernorm.weight": (H,), f"{p}post_attention_layernorm.weight": (H,)}
        if fmt == "dflash":
            w |= {f"{p}self_attn.q_norm.weight": (hd,), f"{p}self_attn.k_norm.weight": (hd,)}
        else:
            w[f"{p}hidden_norm.weight"] = (H,)
        return w

    if fmt == "dflash":
        n = len(cfg["dflash_config"]["target_layer_ids"])
        out = {"fc.weight": (H, n * Ht), "hidden_norm.weight": (H,), "norm.weight": (H,)}
        for i in range(cfg["num_hidden_layers"]):
            out |= layer(f"layers.{i}.")
        return out
    V, Vd = lc["vocab_size"], cfg["draft_vocab_size"]
    return {"fc.weight": (H, 3 * Ht), **layer("midlayer." if fmt == "eagle3-hf" else "layers.0."),
            "norm.weight": (H,), "lm_head.weight": (Vd, H), "d2t": (Vd,), "t2d": (V,)}


def _served_name(fmt: str, name: str) -> str:
    return "layers.0." + name[len("midlayer."):] if fmt == "speculators" and name.startswith("midlayer.") else name


def _internal_name(fmt: str, name: str) -> str:
    return "midlayer." + name[len("layers.0."):] if fmt == "speculators" and name.startswith("layers.0.") else name


# ----------------------------------------------------------------------------- export
def export_draft(
    drafter,
    target,
    out: str | Path,
    *,
    fmt: str | None = None,
    head: AcceptHead | None = None,
    exit_threshold: float | None = None,
    dtype: str | None = None,
    force: bool = False,
    speculative_tokens: int | None = None,
    verifier: str | None = None,
) -> Path:
    """Write ``drafter`` (and ``head`` beside it) as a served draft folder; return the folder.

    ``fmt`` defaults from the drafter kind; ``dtype`` (float32 | bfloat16 | float16) from its weights.
    The folder is written under a temporary name, validated (``validate_export``) and only then
    renamed to ``out``; an existing non-empty ``out`` is replaced only with ``force``.
    """
    fmt = fmt or DEFAULT_FORMAT[drafter.kind]
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    if FORMATS[fmt] != drafter.kind:
        raise ExportError(f"format {fmt!r} serves {FORMATS[fmt]} drafts, not a {drafter.kind} drafter")
    if exit_threshold is not None and head is None:
        raise ExportError("--exit-threshold needs an accept head (the checkpoint has no head.safetensors)")
    _check_exportable(drafter)
    dtype = dtype or {v: k for k, v in DTYPES.items()}.get(drafter.fc.weight.dtype, str(drafter.fc.weight.dtype))
    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    cfg = build_config(fmt, drafter, target, dtype, speculative_tokens=speculative_tokens, verifier=verifier)
    state = {
        _served_name(fmt, k): (v.to(DTYPES[dtype]) if v.is_floating_point() else v).detach().cpu().contiguous()
        for k, v in drafter.state_dict().items()
    }

    def write(folder: Path) -> None:
        (folder / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(state, folder / WEIGHTS, metadata={"format": "pt"})
        if head is not None:
            _write_head(folder / HEAD_DIR, head, drafter, exit_threshold)
        validate_export(folder, target)

    return _write_atomically(Path(out), write, force=force)


def _check_exportable(drafter) -> None:
    c = drafter.config
    if drafter.kind == "eagle3":
        if len(c.target_layer_ids) != 3:
            raise ExportError(f"EAGLE-3 engines read exactly 3 target layers (fc: 3 * target_hidden_size); "
                              f"this draft uses {list(c.target_layer_ids)}")
        if c.hidden_act != "silu":
            raise ExportError(f"the engines' EAGLE-3 MLP is SiLU only; this draft uses hidden_act={c.hidden_act!r}")
    elif c.mask_source == "learned":
        raise ExportError("this DFlash draft learned its own MASK embedding row (drafter.mask_token_id unset and no "
                          "unused target id); served DFlash reads the MASK embedding from the target, so retrain with "
                          "drafter.mask_token_id=<an unused target id>")


def _write_head(folder: Path, head: AcceptHead, drafter, threshold: float | None) -> None:
    folder.mkdir()
    save_file({k: v.detach().float().cpu().contiguous() for k, v in head.state_dict().items()},
              folder / "head.safetensors", metadata={"format": "pt"})
    meta = {"format": HEAD_FORMAT, "version": 1, "drafter_kind": drafter.kind, "input": HEAD_INPUT,
            "hidden_size": int(head.proj.in_features), "threshold": threshold,
            "output": "logit; sigmoid = P(the drafted prefix is still accepted at this position)"}
    (folder / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")


def _write_atomically(out: Path, write, *, force: bool) -> Path:
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} exists and is not empty; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():  # keep the old folder until the new one is in place
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out


# ----------------------------------------------------------------------------- validation
def detect_format(cfg: dict, source: str) -> str:
    """``eagle3-hf`` | ``speculators`` | ``dflash`` from a config.json's contents."""
    if cfg.get("speculators_model_type") is not None:
        if cfg["speculators_model_type"] != "eagle3":
            raise ExportError(f"{source}: speculators_model_type {cfg['speculators_model_type']!r} is not supported "
                              "(only 'eagle3')")
        return "speculators"
    archs = cfg.get("architectures") or []
    if any(a in EAGLE3_ARCHS for a in archs):
        return "eagle3-hf"
    if "DFlashDraftModel" in archs:
        return "dflash"
    raise ExportError(f"{source}: architectures {archs} is neither an EAGLE-3 draft (LlamaForCausalLMEagle3, "
                      "Eagle3Speculator) nor a DFlash draft (DFlashDraftModel)")


def validate_export(path: str | Path, target=None) -> str:
    """Check an export folder against its format; return the format or raise ``ExportError`` listing
    every problem: the exact config fields and their values, the exact tensor names, shapes and dtypes,
    the draft vocabulary maps, the accept head, and (with ``target``) the fit to the target."""
    path = Path(path)
    src = path / CONFIG
    cfg = _read_json(src)
    fmt = detect_format(cfg, str(src))
    bad: list[str] = []
    _check_config(fmt, cfg, bad)
    extra_files = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    extra_files = [n for n in extra_files if n not in (CONFIG, WEIGHTS, HEAD_DIR)]
    if extra_files:
        bad.append(f"unexpected files {extra_files} (an export holds {CONFIG}, {WEIGHTS}, {HEAD_DIR}/)")
    if not bad:
        _check_weights(fmt, cfg, path / WEIGHTS, bad)
    if not bad and target is not None:
        _check_fit(fmt, cfg, target, bad)
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


def _check_fit(fmt: str, cfg: dict, target, bad: list[str]) -> None:
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


def _int_list(x) -> bool:
    return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in x)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ExportError(f"{path} is missing")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ExportError(f"{path}: expected a JSON object")
    return data


# ----------------------------------------------------------------------------- import
def import_draft(path: str | Path, target, *, ttt_steps: int | None = None,
                 device: str | torch.device | None = None):
    """A served draft folder (any of the three formats, ours or third-party) -> this project's drafter,
    attached to ``target``, in float32, in eval mode. EAGLE-3 TTT steps: ``ttt_steps``, else the
    speculators ``speculative_tokens``, else 7 (a training setting the HF format does not record)."""
    path = Path(path)
    src = str(path / CONFIG)
    cfg = _read_json(path / CONFIG)
    fmt = detect_format(cfg, src)
    weights = {_internal_name(fmt, k): v for k, v in _read_weights(path).items()}
    emb = weights.pop("embed_tokens.weight", None)  # speculators' converter adds the verifier's embedding
    if emb is not None and not (emb.shape == target.embed_tokens.weight.shape and torch.allclose(
            emb.float(), target.embed_tokens.weight.detach().float().cpu(), atol=1e-2)):
        warnings.warn(f"{path}: embed_tokens.weight differs from the target's embedding; the drafter uses the "
                      "target's (as SGLang and vLLM do when the shapes agree)", stacklevel=2)
    if fmt == "dflash":
        drafter = DFlashDrafter(_dflash_config(cfg, target, src))
    else:
        drafter = Eagle3Drafter(_eagle3_config(fmt, cfg, target, src, ttt_steps))
        c = drafter.config
        if "d2t" not in weights and "t2d" not in weights and c.draft_vocab_size == c.vocab_size:
            weights["d2t"], weights["t2d"] = drafter.d2t.clone(), torch.ones(c.vocab_size, dtype=torch.bool)
    drafter.attach_target(target)
    try:
        drafter.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise ExportError(f"{path}: the weights do not fit the {fmt} config: {e}") from e
    if fmt != "dflash":
        try:
            check_draft_vocab(drafter.d2t, drafter.t2d)
        except ValueError as e:
            raise ExportError(f"{path}: d2t / t2d: {e}") from e
    return drafter.to(device or target.device).eval()


def _fit(src: str, name: str, have, want) -> None:
    if have != want:
        raise ExportError(f"{src}: {name}={have} does not match the target ({want})")


def _rope(lc: dict) -> tuple[float, dict | None]:
    rp = lc.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" in rp:  # transformers 5 layout
        theta, scaling = float(rp["rope_theta"]), {k: v for k, v in rp.items() if k != "rope_theta"}
    else:
        theta, scaling = float(lc.get("rope_theta", 10000.0)), dict(lc.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return theta, (None if kind == "default" else {"rope_type": kind, **{k: v for k, v in scaling.items()
                                                                        if k not in ("type", "rope_type")}})


def _eagle3_config(fmt: str, cfg: dict, target, src: str, ttt_steps: int | None) -> Eagle3Config:
    lc = cfg.get("transformer_layer_config") if fmt == "speculators" else cfg
    if not isinstance(lc, dict):
        raise ExportError(f"{src}: transformer_layer_config is missing")
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if name not in lc:
            raise ExportError(f"{src}: {name} is missing")
    unsupported = {"num_hidden_layers": lc.get("num_hidden_layers", 1) != 1,
                   "norm_before_residual": bool(cfg.get("norm_before_residual", fmt == "speculators")),
                   "attention_bias": bool(lc.get("attention_bias")), "mlp_bias": bool(lc.get("mlp_bias")),
                   "bias": bool(cfg.get("bias")), "norm_before_fc": bool(cfg.get("norm_before_fc")),
                   "fc_norm": bool(cfg.get("fc_norm")),
                   "use_aux_hidden_state": (cfg.get("eagle_config") or {}).get("use_aux_hidden_state", True) is False}
    for name, hit in unsupported.items():
        if hit:
            raise ExportError(f"{src}: {name}={cfg.get(name, lc.get(name))!r} is an EAGLE-3 variant vatspec's drafter "
                              "does not implement (one llama layer, residual on the pre-norm h, no biases)")
    H, V = lc["hidden_size"], lc["vocab_size"]
    _fit(src, "vocab_size", V, target.vocab_size)
    _fit(src, "target_hidden_size", cfg.get("target_hidden_size") or H, target.hidden_size)
    _fit(src, "hidden_size (the draft shares the target's embedding)", H, target.hidden_size)
    sglang = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") if fmt == "eagle3-hf" else None
    vllm = cfg.get("eagle_aux_hidden_state_layer_ids")
    if sglang is not None:
        ids = [int(i) for i in sglang]
        if vllm is not None and to_vllm_ids(ids) != [int(i) for i in vllm]:
            warnings.warn(f"{src}: eagle_config.eagle_aux_hidden_state_layer_ids {ids} (SGLang, output of layer i) "
                          f"and eagle_aux_hidden_state_layer_ids {vllm} (vLLM, input of layer j) disagree; "
                          "using SGLang's", stacklevel=3)
    elif vllm is not None:
        ids = [int(i) - 1 for i in vllm]
    else:
        ids = list(default_layer_ids(target.num_layers))
    if len(ids) != 3 or min(ids) < 0 or max(ids) >= target.num_layers:
        raise ExportError(f"{src}: layer ids {ids} (output of layer i) do not fit a {target.num_layers}-layer target")
    if ttt_steps is None and fmt == "speculators":
        methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
        ttt_steps = methods[0].get("speculative_tokens")
    nh = lc["num_attention_heads"]
    theta, scaling = _rope(lc)
    try:
        return Eagle3Config(
            hidden_size=H, target_hidden_size=cfg.get("target_hidden_size") or H, num_heads=nh,
            num_kv_heads=lc.get("num_key_value_heads") or nh, head_dim=lc.get("head_dim") or H // nh,
            intermediate_size=lc["intermediate_size"], rms_norm_eps=float(lc.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, vocab_size=V, draft_vocab_size=cfg.get("draft_vocab_size") or V, target_layer_ids=ids,
            ttt_steps=int(ttt_steps or 7), max_position_embeddings=int(lc.get("max_position_embeddings", 2048)),
            hidden_act=lc.get("hidden_act", "silu"), rope_scaling=scaling,
        )
    except ValueError as e:
        raise ExportError(f"{src}: {e}") from e


def _dflash_config(cfg: dict, target, src: str) -> DFlashConfig:
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
    _fit(src, "num_target_layers", NT, target.num_layers)
    _fit(src, "vocab_size", cfg.get("vocab_size", target.vocab_size), target.vocab_size)
    _fit(src, "target_hidden_size", cfg.get("target_hidden_size") or H, target.hidden_size)
    _fit(src, "hidden_size (the draft shares the target's embedding and lm_head)", H, target.hidden_size)
    ids = dc.get("target_layer_ids", cfg.get("target_layer_ids")) or default_target_layer_ids(NT, L)
    ids = [int(i) for i in ids]
    vllm = cfg.get("eagle_aux_hidden_state_layer_ids")
    if vllm is not None and [int(i) for i in vllm] != to_vllm_ids(ids):
        warnings.warn(f"{src}: eagle_aux_hidden_state_layer_ids {vllm} (vLLM) is not dflash_config.target_layer_ids "
                      f"{ids} + 1; using dflash_config", stacklevel=3)
    mask_id, mask = dc.get("mask_token_id", cfg.get("mask_token_id")), dc.get("mask_token")
    if mask_id is None:  # as SGLang: look the mask string up in the target's vocabulary
        vocab = target.tokenizer.get_vocab() if target.tokenizer is not None else {}
        mask = mask or "<|MASK|>"
        mask_id = vocab.get(mask)
        if mask_id is None:
            raise ExportError(f"{src}: dflash_config.mask_token_id is missing and the target's tokenizer "
                              f"has no {mask!r}")
    nh = cfg["num_attention_heads"]
    theta, scaling = _rope(cfg)
    try:
        return DFlashConfig(
            target_layer_ids=tuple(ids), num_target_layers=NT, target_hidden_size=cfg.get("target_hidden_size") or H,
            vocab_size=target.vocab_size, hidden_size=H, num_attention_heads=nh,
            num_key_value_heads=cfg.get("num_key_value_heads") or nh, head_dim=cfg.get("head_dim") or H // nh,
            intermediate_size=cfg["intermediate_size"], mask_token_id=int(mask_id), mask_source="override",
            mask_token=mask, num_layers=L, block_size=int(dc.get("block_size", cfg.get("block_size", 16))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            target_model_type=str(cfg.get("model_type", "qwen3")),
        )
    except ValueError as e:
        raise ExportError(f"{src}: {e}") from e


def _read_weights(path: Path) -> dict[str, Tensor]:
    """model.safetensors, a sharded safetensors index, or pytorch_model.bin (older EAGLE-3 releases)."""
    if (path / WEIGHTS).is_file():
        return load_file(path / WEIGHTS)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
        return {k: v for s in shards for k, v in load_file(path / s).items()}
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ExportError(f"{path}: no {WEIGHTS}, model.safetensors.index.json or pytorch_model.bin")


def load_accept_head(path: str | Path, *, device: str | torch.device | None = None) -> tuple[AcceptHead, float | None]:
    """The VAT accept head saved beside a served draft (the export folder or its ``accept_head/``)
    -> ``(head, exit threshold | None)``. The head reads the drafter's post-norm last hidden state."""
    folder = Path(path)
    folder = folder / HEAD_DIR if (folder / HEAD_DIR).is_dir() else folder
    meta = _read_json(folder / CONFIG)
    src = f"{HEAD_DIR}/{CONFIG}"
    if meta.get("format") != HEAD_FORMAT or meta.get("input") != HEAD_INPUT:
        raise ExportError(f"{src}: format {meta.get('format')!r} / input {meta.get('input')!r}, "
                          f"expected {HEAD_FORMAT!r} / {HEAD_INPUT!r}")
    thr = meta.get("threshold")
    if thr is not None and not (isinstance(thr, (int, float)) and 0.0 <= thr <= 1.0):
        raise ExportError(f"{src}: threshold {thr!r} must be a probability in [0, 1] or null")
    head = AcceptHead(int(meta["hidden_size"]))
    file = folder / "head.safetensors"
    if not file.is_file():
        raise ExportError(f"{HEAD_DIR}/head.safetensors is missing")
    try:
        head.load_state_dict(load_file(file), strict=True)
    except RuntimeError as e:
        raise ExportError(f"{HEAD_DIR}/head.safetensors does not fit hidden_size={meta['hidden_size']}: {e}") from e
    return head.to(device or "cpu").eval(), (None if thr is None else float(thr))


def load_any_draft(path: str | Path, target, *, device: str | torch.device | None = None,
                   ttt_steps: int | None = None):
    """``(drafter, head | None)`` from a training checkpoint, a run folder or an exported draft folder.

    ``ttt_steps`` (EAGLE-3) replaces the draft's TTT unroll length, e.g. the run's own setting when
    fine-tuning a published draft (``vatspec train --init-from``)."""
    p = Path(path)
    if (p / "drafter.safetensors").is_file() or (p / "latest").is_file():
        drafter, head = load_draft(resolve_checkpoint(p), target, device=device)
        if ttt_steps is not None and drafter.kind == "eagle3" and ttt_steps != drafter.config.ttt_steps:
            new = Eagle3Drafter(replace(drafter.config, ttt_steps=int(ttt_steps)))
            new.attach_target(target)
            new.load_state_dict(drafter.state_dict())
            drafter = new.to(device or target.device).eval()
        return drafter, head
    if (p / CONFIG).is_file():
        drafter = import_draft(p, target, ttt_steps=ttt_steps, device=device)
        head = load_accept_head(p, device=device or target.device)[0] if (p / HEAD_DIR).is_dir() else None
        return drafter, head
    raise ExportError(f"{p} is neither a training checkpoint (drafter.safetensors), a run folder (latest) "
                      f"nor an exported draft ({CONFIG})")


# ----------------------------------------------------------------------------- CLI
def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint folder, or a run folder (-> its latest checkpoint)")
    parser.add_argument("--format", choices=list(FORMATS), help="default: eagle3-hf for EAGLE-3, dflash for DFlash")
    parser.add_argument("--out", required=True, help="the folder to write (must not exist or be empty)")
    parser.add_argument("--target", help="target model folder; default: target.path of the checkpoint's config.yaml")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    parser.add_argument("--dtype", choices=list(DTYPES), help="weights dtype; default: as trained")
    parser.add_argument("--exit-threshold", type=float, help="accept-head early-exit threshold stored beside the draft")
    parser.add_argument("--speculative-tokens", type=int, help="speculators: tokens per round (default: TTT steps)")
    parser.add_argument("--verifier", help="speculators: the target's name for `vllm serve DIR` (default: its path)")


def run(args: argparse.Namespace) -> int:
    from vatspec.target import TargetError

    try:
        ckpt = resolve_checkpoint(args.checkpoint)
        target_path = args.target or _saved_target_path(ckpt)
        target = target_shell(target_path)
        drafter, head = load_draft(ckpt, target, device="cpu")
        fmt = args.format or DEFAULT_FORMAT[drafter.kind]
        out = export_draft(drafter, target, args.out, fmt=fmt, head=head, exit_threshold=args.exit_threshold,
                           dtype=args.dtype, force=args.force, speculative_tokens=args.speculative_tokens,
                           verifier=args.verifier)
    except (CheckpointError, TargetError, ValueError) as e:
        print(f"vatspec export: error: {e}", file=sys.stderr)
        return 2
    ids = list(drafter.target_layer_ids)
    print(f"wrote a validated {fmt} draft to {out} (target {target_path})")
    print(f"  layer ids: ours/SGLang/DFlash (output of layer i) {ids}; vLLM (input of layer j) {to_vllm_ids(ids)}")
    if head is not None:
        print(f"  accept head: {out / HEAD_DIR} (threshold {args.exit_threshold}); not part of the served weights")
    print("  launch commands: docs/serving.md")
    return 0


def target_shell(name_or_path: str | Path | None):
    """The target's config and tokenizer, its modules on the meta device: everything an export reads
    (sizes, layer count, model family, MASK token), without loading a single weight."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from vatspec.target import DEFAULT_NAME, Target, TargetError, prepare_default_target

    default = name_or_path in (None, "", "default", "smollm2", DEFAULT_NAME)
    path = prepare_default_target() if default else Path(name_or_path)
    if not (Path(path) / "config.json").is_file():
        raise TargetError(f"target path {path} has no config.json: not a Hugging Face model folder")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return Target(model, AutoTokenizer.from_pretrained(path), path)


def _saved_target_path(ckpt: Path) -> str:
    import yaml

    saved = ckpt / "config.yaml"
    path = None
    if saved.is_file():
        path = ((yaml.safe_load(saved.read_text()) or {}).get("target") or {}).get("path")
    if not path:
        raise ExportError(f"{saved} names no target.path; pass --target")
    return str(path)


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
    "load_any_draft",
    "target_shell",
    "to_vllm_ids",
    "validate_export",
]
