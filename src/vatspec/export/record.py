"""``vatspec.json``: what an export records of its training, for ``vatspec check``.

The engines never read it (they load ``config.json`` and ``*.safetensors``). It holds:

    {"format": "vatspec-record", "version": 1, "drafter_kind": "eagle3",
     "target_layer_ids": [1, 14, 26],            ours: output of layer i, as trained
     "target": {"vocab_size": ..., "num_layers": ..., "hidden_size": ...,
                "tokenizer_sha256": ..., "chat_template_sha256": ...,
                "chat_template_kwargs": {"enable_thinking": false}},   the template arguments trained with
     "training": {"checkpoint": ..., "step": 48, "k": 3,
                  "heldout": {"step": 48, "tau_sim": 1.21, "cond_acc": [...], "chains": 1467}} | null}

``training`` is null for a draft exported from something other than a training run (an imported
draft), and ``heldout`` null for a run that never evaluated.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

RECORD = "vatspec.json"
RECORD_FORMAT = "vatspec-record"


def target_fingerprint(target, template=None) -> dict:
    """Sizes and tokenizer identity of ``target``: the vocabulary (token -> id) and the chat template
    hashed, so a draft served with another tokenizer is caught even when the sizes agree; the arguments
    and date of ``template`` (a ``ChatTemplate``; None: not known, none recorded)."""
    tok = target.tokenizer
    out = {"vocab_size": target.vocab_size, "num_layers": target.num_layers, "hidden_size": target.hidden_size,
           "tokenizer_sha256": None, "chat_template_sha256": None}
    if tok is not None and hasattr(tok, "get_vocab"):
        vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
        out["tokenizer_sha256"] = _sha(json.dumps(vocab, ensure_ascii=False))
        text = getattr(tok, "chat_template", None)
        out["chat_template_sha256"] = _sha(text) if isinstance(text, str) else None
    if template is not None:
        out["chat_template_kwargs"] = dict(sorted(template.kwargs.items()))
        if template.date:
            out["chat_template_date"] = template.date
    return out


def training_record(checkpoint: Path, k: int) -> dict:
    """The checkpoint's step and the held-out metrics its run logged at or before it (``metrics.jsonl``
    of ``RUN`` for ``RUN/checkpoints/step-N``)."""
    checkpoint = Path(checkpoint)
    step = _step_of(checkpoint)
    metrics = checkpoint.parent.parent / "metrics.jsonl"
    heldout = None
    if metrics.is_file() and step is not None:
        for line in metrics.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a killed run
            if isinstance(rec, dict) and "eval/tau_sim" in rec and rec.get("step", step + 1) <= step:
                heldout = {"step": rec["step"], "tau_sim": rec["eval/tau_sim"], "cond_acc": rec.get("eval/cond_acc"),
                           "chains": rec.get("eval/chains")}
    return {"checkpoint": str(checkpoint.resolve()), "step": step, "k": k, "heldout": heldout}


def make_record(drafter, target, training: dict | None, template=None) -> dict:
    """The record of an export; ``template`` None (a served draft re-exported: its training is not known)
    records no template arguments, so neither the card nor ``check`` claims any."""
    return {"format": RECORD_FORMAT, "version": 1, "drafter_kind": drafter.kind,
            "target_layer_ids": [int(i) for i in drafter.config.target_layer_ids],
            "target": target_fingerprint(target, template), "training": training}


def read_record(folder: Path) -> dict | None:
    """The folder's record, or None when it has none, or one this version does not read or that is malformed."""
    file = Path(folder) / RECORD
    if not file.is_file():
        return None
    try:
        rec = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return rec if isinstance(rec, dict) and rec.get("format") == RECORD_FORMAT and _well_formed(rec) else None


def _well_formed(rec: dict) -> bool:
    """The fields readers use have their types (a hand-edited record with string template arguments or layer ids
    is no record, and ``check`` says so, instead of failing inside a comparison)."""
    tgt = rec.get("target", {})
    if not isinstance(tgt, dict):
        return False
    kwargs, date = tgt.get("chat_template_kwargs"), tgt.get("chat_template_date")
    ids = rec.get("target_layer_ids")
    return ((kwargs is None or isinstance(kwargs, dict)) and (date is None or isinstance(date, str))
            and (ids is None or isinstance(ids, list) and all(isinstance(i, int) for i in ids)))


def _step_of(checkpoint: Path) -> int | None:
    name = checkpoint.name
    return int(name.removeprefix("step-")) if name.startswith("step-") and name[5:].isdigit() else None


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def recorded_template(path: str | Path) -> dict | None:
    """The chat template settings a draft was trained with, where it records them: an export's
    ``vatspec.json`` (the template's sha256 and arguments), a run folder's or checkpoint's config
    (``data.chat_template_kwargs``). None when nothing is recorded."""
    rec = read_record(Path(path)) if Path(path).is_dir() else None
    if rec is not None:
        tgt = rec.get("target") or {}
        return {k: tgt[k] for k in ("chat_template_sha256", "chat_template_kwargs", "chat_template_date")
                if k in tgt} or None
    from vatspec.checkpoint import CheckpointError, resolve_checkpoint, saved_config
    from vatspec.data.chat import parse_kwargs

    try:
        ckpt = resolve_checkpoint(path)
        trainer = json.loads((ckpt / "trainer.json").read_text()) if (ckpt / "trainer.json").is_file() else {}
        if isinstance(trainer.get("chat_template"), dict):  # the settings the run trained with
            return trainer["chat_template"]
        data = saved_config(path).data  # a checkpoint from before they were saved: the config's arguments
    except (CheckpointError, OSError, json.JSONDecodeError):
        return None
    return {"chat_template_kwargs": parse_kwargs(data.chat_template_kwargs, "data.chat_template_kwargs")}
