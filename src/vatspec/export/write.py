"""Formats out: a drafter (and its accept head) -> a validated served draft folder."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from vatspec.drafters.base import HEAD_RULES, AcceptHead
from vatspec.drafters.dflash import DFlashConfig
from vatspec.drafters.eagle3 import Eagle3Config
from vatspec.export.card import write_card
from vatspec.export.formats import (
    CONFIG,
    DEFAULT_FORMAT,
    FORMATS,
    HEAD_DIR,
    HEAD_FORMAT,
    HEAD_INPUT,
    MASK_FILE,
    WEIGHTS,
    ExportError,
    served_name,
    to_vllm_ids,
)
from vatspec.export.record import RECORD, make_record
from vatspec.export.validate import validate_export
from vatspec.outputs import WRITE_ERRORS, pid_alive, user_mode, write_error
from vatspec.target import DTYPES, dtype_name


# ----------------------------------------------------------------------------- config.json
def _layer_fields(c: Eagle3Config | DFlashConfig, num_layers: int) -> dict:
    """The decoder-layer fields both engines read (a LlamaConfig / Qwen3Config subset)."""
    heads = c.num_heads if isinstance(c, Eagle3Config) else c.num_attention_heads
    kv = c.num_kv_heads if isinstance(c, Eagle3Config) else c.num_key_value_heads
    return {
        # the layer's family: EAGLE-3's is a Llama layer; DFlash's has q/k norms, a Qwen3 layer (the z-lab
        # reference builds it from a Qwen3Config whatever the target is)
        "model_type": "llama" if isinstance(c, Eagle3Config) else "qwen3",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": c.head_dim, "hidden_act": getattr(c, "hidden_act", "silu"), "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings, "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    }


def build_config(fmt: str, drafter, target, dtype: str, *, k: int | None = None,
                 verifier: str | None = None, mask_token_id: int | None = None) -> dict:
    """The config.json of ``drafter`` in format ``fmt`` (see the module docstring for the ids).

    speculators only: ``k`` tokens drafted per round, written as ``speculative_tokens`` (default:
    ``drafter.k``, the TTT steps) and ``verifier``, the target name vLLM loads when serving the draft
    folder alone (default: the target's path). dflash only: ``mask_token_id`` serves a learned MASK row
    (``served_mask_id``)."""
    c = drafter.config
    ids = sorted(int(i) for i in c.target_layer_ids)  # the engines capture layers in this order
    if fmt == "dflash":
        mask_id = served_mask_id(drafter, mask_token_id)
        mask = {"mask_token_id": mask_id, "target_layer_ids": ids}
        tok = getattr(target, "tokenizer", None)
        name = c.mask_token if mask_id == c.mask_token_id else (tok.convert_ids_to_tokens(mask_id) if tok else None)
        if name is not None:  # SGLang checks that the tokenizer maps this string to the id (default "<|MASK|>")
            mask["mask_token"] = name
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
    proposal = {"proposal_type": "greedy", "speculative_tokens": int(k or drafter.k),
                "verifier_accept_k": 1, "accept_tolerance": 0.0}
    verifier = {"name_or_path": verifier or target.path or getattr(cfg, "_name_or_path", None) or None,
                "architectures": list(getattr(cfg, "architectures", None) or [])}
    return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "torch_dtype": dtype,
            "transformer_layer_config": _layer_fields(c, 1), **eagle,
            "eagle_aux_hidden_state_layer_ids": to_vllm_ids(ids),
            "speculators_config": {"algorithm": "eagle3", "proposal_methods": [proposal],
                                   "default_proposal_method": "greedy", "verifier": verifier}}


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
    k: int | None = None,
    verifier: str | None = None,
    training: dict | None = None,
    mask_token_id: int | None = None,
) -> Path:
    """Write ``drafter`` (and ``head`` beside it) as a served draft folder; return the folder.

    ``fmt`` defaults from the drafter kind; ``dtype`` (float32 | bfloat16 | float16, or an alias) from its weights.
    The folder is written under a temporary name, validated (``validate_export``) and only then
    renamed to ``out``; an existing non-empty ``out`` is replaced only with ``force``. Beside the
    weights, ``vatspec.json`` records the layer ids trained on, the target's tokenizer identity and
    ``training`` (``record.training_record``: the checkpoint and its held-out metrics) for ``vatspec check``.
    A DFlash draft that learned its MASK row is served with ``mask_embedding.pt`` for the target id
    ``mask_token_id`` (``served_mask_id``).
    """
    fmt = fmt or DEFAULT_FORMAT[drafter.kind]
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    if FORMATS[fmt] != drafter.kind:
        raise ExportError(f"format {fmt!r} serves {FORMATS[fmt]} drafts, not a {drafter.kind} drafter")
    if mask_token_id is not None and drafter.kind != "dflash":
        raise ExportError("--mask-token-id is for DFlash drafts")
    if exit_threshold is not None and head is None:
        raise ExportError("--exit-threshold needs an accept head (the checkpoint has no head.safetensors)")
    _check_exportable(drafter)
    try:
        dtype = dtype_name(dtype or drafter.fc.weight.dtype)
    except ValueError as e:
        raise ExportError(str(e)) from None
    cfg = build_config(fmt, drafter, target, dtype, k=k, verifier=verifier, mask_token_id=mask_token_id)
    state_mask = None  # the form both engines read: a dict, the row [H]
    if drafter.kind == "dflash" and drafter.config.mask_source == "learned":
        state_mask = {"mask_token_id": cfg["dflash_config"]["mask_token_id"],
                      "embedding": drafter.mask_embedding.detach().to(DTYPES[dtype]).cpu().contiguous()}
    state = {
        served_name(fmt, name): (v.to(DTYPES[dtype]) if v.is_floating_point() else v).detach().cpu().contiguous()
        for name, v in served_state(fmt, drafter, target).items()
        if name != "mask_embedding"  # served beside the weights: the engines read it from its own file
    }

    def write(folder: Path) -> None:
        (folder / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(state, folder / WEIGHTS, metadata={"format": "pt"})
        user_mode(folder / WEIGHTS)  # an engine in a container runs as another user
        (folder / RECORD).write_text(json.dumps(make_record(drafter, target, training), indent=2) + "\n")
        write_card(folder, fmt, target.path, drafter.k, Path(out))
        if state_mask is not None:
            torch.save(state_mask, folder / MASK_FILE)
        if head is not None:
            _write_head(folder / HEAD_DIR, head, drafter, exit_threshold)
        validate_export(folder, target)

    return _write_atomically(Path(out), write, force=force)


def served_state(fmt: str, drafter, target) -> dict[str, Tensor]:
    """The drafter's tensors as the engines read them (internal names, the drafter's dtype):

    * ``fc``'s input blocks in increasing layer order: both engines capture the target's layers in
      the order they run, whatever order the config lists them in, so a drafter trained on ids
      (26, 1, 14) has its columns permuted to (1, 14, 26);
    * speculators: ``embed_tokens.weight``, the target's input embedding. The speculators library
      fills a missing embedding with uninitialised memory when it loads, and vLLM shares the
      target's only when the two are equal."""
    state = dict(drafter.state_dict())
    ids = [int(i) for i in drafter.config.target_layer_ids]
    order = sorted(range(len(ids)), key=ids.__getitem__)
    if order != list(range(len(ids))):
        blocks = state["fc.weight"].chunk(len(ids), dim=1)  # [H, Ht] each, in the drafter's order
        state["fc.weight"] = torch.cat([blocks[j] for j in order], dim=1)
    if fmt == "speculators":
        state["embed_tokens.weight"] = target.input_embedding()
    return state


def _check_exportable(drafter) -> None:
    c = drafter.config
    ids = list(c.target_layer_ids)
    if len(set(ids)) != len(ids):
        raise ExportError(f"the draft reads layer ids {ids} with a repeat; the engines capture each layer once")
    if drafter.kind == "eagle3":
        if len(c.target_layer_ids) != 3:
            raise ExportError(f"EAGLE-3 engines read exactly 3 target layers (fc: 3 * target_hidden_size); "
                              f"this draft uses {list(c.target_layer_ids)}")
        if c.hidden_act != "silu":
            raise ExportError(f"the engines' EAGLE-3 MLP is SiLU only; this draft was trained with hidden_act="
                              f"{c.hidden_act!r} (built before drafts were given SiLU whatever the target runs): "
                              "retrain it to serve it")


def served_mask_id(drafter, mask_token_id: int | None) -> int:
    """The MASK id a DFlash export writes. A draft that learned its own MASK row trained it as an id past
    the vocabulary (``vocab_size``); both engines take a learned row from ``mask_embedding.pt`` only
    for an id inside it, so serving needs ``mask_token_id``: a target id that never occurs in the text
    drafted (vLLM swaps the row into the draft's own lookup of that id; SGLang writes it into the
    target's embedding row of that id)."""
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


def _write_head(folder: Path, head: AcceptHead, drafter, threshold: float | None) -> None:
    folder.mkdir()
    save_file({k: v.detach().float().cpu().contiguous() for k, v in head.state_dict().items()},
              folder / "head.safetensors", metadata={"format": "pt"})
    user_mode(folder / "head.safetensors")
    meta = {"format": HEAD_FORMAT, "version": 1, "drafter_kind": drafter.kind, "input": HEAD_INPUT,
            "hidden_size": int(head.proj.in_features), "threshold": threshold, "label": head.label,
            "output": f"logit; sigmoid = {HEAD_RULES[head.label]}"}
    (folder / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")


def _remove_leftovers(out: Path) -> None:
    """The ``.OUT.tmp-PID`` / ``.OUT.old-PID`` folders of earlier exports to ``out`` whose process is gone (killed,
    SIGTERM: a full copy of the weights each): removed. A live process's are its own."""
    for stale in out.parent.glob(f".{out.name}.*-*"):
        kind, _, pid = stale.name[len(out.name) + 2:].partition("-")
        if kind in ("tmp", "old") and pid.isdigit() and stale.is_dir() and not pid_alive(pid):
            shutil.rmtree(stale, ignore_errors=True)


def _write_atomically(out: Path, write, *, force: bool) -> Path:
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} exists and is not empty; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = "the earlier export is as it was" if out.exists() else "nothing is kept"
        if isinstance(e, WRITE_ERRORS):  # a full disk, a quota
            raise ExportError(f"{out}: could not be written ({write_error(e)}); {kept}") from e
        if isinstance(e, ExportError) and str(tmp) in str(e):  # a check of the written files: name --out
            raise ExportError(str(e).replace(str(tmp), str(out))) from e
        raise
    if out.exists():  # keep the old folder until the new one is in place
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out

