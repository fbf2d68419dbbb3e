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

from vatspec.drafters import DRAFTERS
from vatspec.drafters.base import HEAD_RULES, AcceptHead
from vatspec.drafters.served import embedding_matches
from vatspec.drafters.vocab import check_draft_vocab
from vatspec.export.formats import CONFIG, HEAD_DIR, HEAD_FORMAT, HEAD_INPUT, WEIGHTS, ExportError, detect, read_json


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
    """A served draft folder (any format of ``vatspec.export``, ours or third-party) -> this project's drafter,
    attached to ``target``, in float32, in eval mode. ``k``: the drafted length where the drafter's is a setting
    (EAGLE-3's TTT steps: ``k``, else the speculators ``speculative_tokens``, else ``DEFAULT_TTT_STEPS``, a
    training setting the HF format does not record); a DFlash draft's k is its block_size - 1."""
    path = Path(path)
    src = str(path / CONFIG)
    cfg = read_json(path / CONFIG)
    fmt = detect(cfg, src)
    raw = _read_weights(path)
    weights = {fmt.internal_name(name): v for name, v in raw.items()}
    served = {fmt.internal_name(name): name for name in raw}  # errors name the file's tensors
    emb = weights.pop("embed_tokens.weight", None)  # speculators exports carry the verifier's embedding
    if emb is not None and not embedding_matches(emb, target):
        warnings.warn(f"{path}: embed_tokens.weight differs from the target's embedding; the drafter uses the "
                      "target's (as SGLang and vLLM do when the shapes agree)", stacklevel=2)
    config, weights = fmt.read(path, cfg, weights, target, k=k)
    drafter = DRAFTERS[fmt.kind](config)
    drafter.attach_target(target)
    _check_fit(drafter, weights, served, f"{path}: the weights do not fit the {fmt.name} config.json")
    drafter.load_state_dict(weights, strict=True)
    if drafter.d2t is not None:  # a reduced draft vocabulary: its maps must be consistent
        try:
            check_draft_vocab(drafter.d2t, drafter.t2d)
        except ValueError as e:
            raise ExportError(f"{path}: d2t / t2d: {e}") from e
    return drafter.to(device or target.device).eval()


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
