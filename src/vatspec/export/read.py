"""Formats in: a served draft folder (ours or third-party) -> this project's drafter, and the
VAT accept head saved beside it. Fails with the field at fault when the draft does not fit the target."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from vatspec.drafters import DEFAULT_TTT_STEPS
from vatspec.drafters.base import HEAD_RULES, AcceptHead
from vatspec.drafters.dflash import DFlashConfig, DFlashDrafter
from vatspec.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from vatspec.drafters.layers import rope_parameters
from vatspec.drafters.vocab import check_draft_vocab
from vatspec.export.formats import (
    CONFIG,
    HEAD_DIR,
    HEAD_FORMAT,
    HEAD_INPUT,
    MASK_FILE,
    WEIGHTS,
    ExportError,
    detect_format,
    internal_name,
    read_json,
    served_layer_ids,
)


# ----------------------------------------------------------------------------- import
def _check_fit(module: torch.nn.Module, weights: dict[str, torch.Tensor], served: dict[str, str], what: str) -> None:
    """One line naming each tensor (as the file names it) whose shape the config does not give it, and the
    missing or unexpected ones."""
    want = {k: list(v.shape) for k, v in module.state_dict().items()}
    bad = [f"{served.get(k, k)} is {list(weights[k].shape)}, the config makes it {want[k]}"
           for k in want if k in weights and list(weights[k].shape) != want[k]]
    bad += [f"{served.get(k, k)} is missing" for k in sorted(set(want) - set(weights))]
    bad += [f"{served.get(k, k)} is not a tensor of this drafter" for k in sorted(set(weights) - set(want))]
    if bad:
        raise ExportError(f"{what}: " + "; ".join(bad[:4]) + (f"; and {len(bad) - 4} more" if len(bad) > 4 else ""))


def import_draft(path: str | Path, target, *, k: int | None = None,
                 device: str | torch.device | None = None):
    """A served draft folder (any of the three formats, ours or third-party) -> this project's drafter,
    attached to ``target``, in float32, in eval mode. EAGLE-3 only, its ``k`` (TTT steps): ``k``, else
    the speculators ``speculative_tokens``, else ``DEFAULT_TTT_STEPS`` (a training setting the HF format
    does not record); a DFlash draft's k is its block_size - 1."""
    path = Path(path)
    src = str(path / CONFIG)
    cfg = read_json(path / CONFIG)
    fmt = detect_format(cfg, src)
    raw = _read_weights(path)
    weights = {internal_name(fmt, name): v for name, v in raw.items()}
    served = {internal_name(fmt, name): name for name in raw}  # errors name the file's tensors
    emb = weights.pop("embed_tokens.weight", None)  # speculators exports carry the verifier's embedding
    if emb is not None and not embedding_matches(emb, target):
        warnings.warn(f"{path}: embed_tokens.weight differs from the target's embedding; the drafter uses the "
                      "target's (as SGLang and vLLM do when the shapes agree)", stacklevel=2)
    if fmt == "dflash":
        mask_row = read_mask_embedding(path)
        if mask_row is not None:
            weights["mask_embedding"] = mask_row[1]
        drafter = DFlashDrafter(_dflash_config(cfg, target, src, mask_row[0] if mask_row else None))
    else:
        drafter = Eagle3Drafter(_eagle3_config(fmt, cfg, target, src, k))
        c = drafter.config
        if "d2t" not in weights and "t2d" not in weights and c.draft_vocab_size == c.vocab_size:
            weights["d2t"], weights["t2d"] = drafter.d2t.clone(), torch.ones(c.vocab_size, dtype=torch.bool)
    drafter.attach_target(target)
    _check_fit(drafter, weights, served, f"{path}: the weights do not fit the {fmt} config.json")
    drafter.load_state_dict(weights, strict=True)
    if fmt != "dflash":
        try:
            check_draft_vocab(drafter.d2t, drafter.t2d)
        except ValueError as e:
            raise ExportError(f"{path}: d2t / t2d: {e}") from e
    return drafter.to(device or target.device).eval()


EMBEDDING_ATOL = 1e-2  # a bfloat16 copy of the target's embedding rounds by far less


def embedding_matches(emb: Tensor, target) -> bool:
    """Whether a served ``embed_tokens.weight`` is the target's input embedding (up to dtype rounding)."""
    want = target.input_embedding()
    return emb.shape == want.shape and bool(torch.allclose(emb.float(), want.float(), atol=EMBEDDING_ATOL))


def engine_layer_order(ids: list[int], src: str) -> list[int]:
    """The ids as the engines use them: they capture the target's layers in the order those run, so
    ``fc`` reads the features in increasing layer order whatever order the config lists."""
    if ids != sorted(ids):
        warnings.warn(f"{src}: layer ids {ids} are not in increasing order; the engines feed fc the layers in "
                      f"the order they run ({sorted(ids)}), and so does this import", stacklevel=3)
    return sorted(ids)


def _fit(src: str, name: str, have, want) -> None:
    if have != want:
        raise ExportError(f"{src}: {name}={have} does not match the target ({want})")


def _eagle3_config(fmt: str, cfg: dict, target, src: str, k: int | None) -> Eagle3Config:
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
    ids, problems = served_layer_ids(fmt, cfg, target.num_layers)
    for problem in problems:
        warnings.warn(f"{src}: {problem}", stacklevel=3)
    ids = engine_layer_order(ids, src)
    if len(ids) != 3 or min(ids) < 0 or max(ids) >= target.num_layers:
        raise ExportError(f"{src}: layer ids {ids} (output of layer i) do not fit a {target.num_layers}-layer target")
    if k is None and fmt == "speculators":
        methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
        k = methods[0].get("speculative_tokens")
    nh = lc["num_attention_heads"]
    theta, scaling = rope_parameters(lc)
    try:
        return Eagle3Config(
            hidden_size=H, target_hidden_size=cfg.get("target_hidden_size") or H, num_heads=nh,
            num_kv_heads=lc.get("num_key_value_heads") or nh, head_dim=lc.get("head_dim") or H // nh,
            intermediate_size=lc["intermediate_size"], rms_norm_eps=float(lc.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, vocab_size=V, draft_vocab_size=cfg.get("draft_vocab_size") or V, target_layer_ids=ids,
            ttt_steps=int(k or DEFAULT_TTT_STEPS), max_position_embeddings=int(lc.get("max_position_embeddings", 2048)),
            hidden_act=lc.get("hidden_act", "silu"), rope_scaling=scaling,
        )
    except ValueError as e:
        raise ExportError(f"{src}: {e}") from e


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


def _dflash_config(cfg: dict, target, src: str, learned_id: int | None = None) -> DFlashConfig:
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
    ids, problems = served_layer_ids("dflash", cfg, target.num_layers)
    for problem in problems:
        warnings.warn(f"{src}: {problem}", stacklevel=3)
    mask_id, mask = dc.get("mask_token_id", cfg.get("mask_token_id")), dc.get("mask_token")
    if mask_id is None:  # as SGLang: look the mask string up in the target's vocabulary
        vocab = target.tokenizer.get_vocab() if target.tokenizer is not None else {}
        mask = mask or "<|MASK|>"
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


def _read_weights(path: Path) -> dict[str, Tensor]:
    """model.safetensors, a sharded safetensors index, or pytorch_model.bin (older EAGLE-3 releases)."""
    index = path / "model.safetensors.index.json"
    if (path / WEIGHTS).is_file():
        files = [path / WEIGHTS]
    elif index.is_file():
        files = [path / s for s in sorted(set(read_json(index).get("weight_map", {}).values()))]
    elif (path / "pytorch_model.bin").is_file():
        files = [path / "pytorch_model.bin"]
    else:
        raise ExportError(f"{path}: no {WEIGHTS}, model.safetensors.index.json or pytorch_model.bin")
    try:
        return {k: v for f in files for k, v in (
            torch.load(f, map_location="cpu", weights_only=True) if f.suffix == ".bin" else load_file(f)).items()}
    except (OSError, RuntimeError, SafetensorError, pickle.UnpicklingError) as e:
        raise ExportError(f"{path}: unreadable weights ({e})") from e


def load_accept_head(path: str | Path, *, device: str | torch.device | None = None) -> tuple[AcceptHead, float | None]:
    """The VAT accept head saved beside a served draft (the export folder or its ``accept_head/``)
    -> ``(head, exit threshold | None)``. The head reads the drafter's post-norm last hidden state."""
    folder = Path(path)
    folder = folder / HEAD_DIR if (folder / HEAD_DIR).is_dir() else folder
    meta = read_json(folder / CONFIG)
    src = f"{HEAD_DIR}/{CONFIG}"
    if meta.get("format") != HEAD_FORMAT or meta.get("input") != HEAD_INPUT:
        raise ExportError(f"{src}: format {meta.get('format')!r} / input {meta.get('input')!r}, "
                          f"expected {HEAD_FORMAT!r} / {HEAD_INPUT!r}")
    thr = meta.get("threshold")
    if thr is not None and not (isinstance(thr, (int, float)) and 0.0 <= thr <= 1.0):
        raise ExportError(f"{src}: threshold {thr!r} must be a probability in [0, 1] or null")
    size = meta.get("hidden_size")
    if not (isinstance(size, int) and size > 0):
        raise ExportError(f"{src}: hidden_size {size!r} must be a positive integer")
    label = meta.get("label", "alive")  # an export older than DSpark's head: VAT's
    if label not in HEAD_RULES:
        raise ExportError(f"{src}: label {label!r} must be one of {tuple(HEAD_RULES)}")
    head = AcceptHead(size, label=label)
    file = folder / "head.safetensors"
    if not file.is_file():
        raise ExportError(f"{HEAD_DIR}/head.safetensors is missing")
    try:
        head.load_state_dict(load_file(file), strict=True)
    except (RuntimeError, OSError, SafetensorError) as e:
        raise ExportError(f"{HEAD_DIR}/head.safetensors does not fit hidden_size={size}: {e}") from e
    return head.to(device or "cpu").eval(), (None if thr is None else float(thr))
