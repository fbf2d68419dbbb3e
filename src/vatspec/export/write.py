"""Formats out: a drafter (and its accept head) -> a validated served draft folder."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors.torch import save_file

from vatspec.drafters.base import HEAD_RULES, AcceptHead
from vatspec.export.card import write_card
from vatspec.export.formats import (
    CONFIG,
    HEAD_DIR,
    HEAD_FORMAT,
    HEAD_INPUT,
    WEIGHTS,
    ExportError,
    default_format,
    served_format,
)
from vatspec.export.record import RECORD, make_record
from vatspec.export.validate import validate_export
from vatspec.outputs import WRITE_ERRORS, pid_alive, strict_json, user_mode, write_error
from vatspec.target import DTYPES, dtype_name


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
    template=None,
) -> Path:
    """Write ``drafter`` (and ``head`` beside it) as a served draft folder; return the folder.

    ``fmt`` defaults from the drafter kind; ``dtype`` (float32 | bfloat16 | float16, or an alias) from its weights.
    The folder is written under a temporary name, validated (``validate_export``) and only then
    renamed to ``out``; an existing non-empty ``out`` is replaced only with ``force``. Beside the
    weights, ``vatspec.json`` records the layer ids trained on, the target's tokenizer identity and
    ``training`` (``record.training_record``: the checkpoint and its held-out metrics) for ``vatspec check``,
    and the arguments and date of ``template``, the ``ChatTemplate`` it was trained with (None: the tokenizer's own).
    A DFlash draft that learned its MASK row is served with ``mask_embedding.pt`` for the target id
    ``mask_token_id`` (``served_mask_id``).
    """
    served = served_format(fmt or default_format(drafter))
    fmt = served.name
    if served.kind != drafter.kind:
        raise ExportError(f"format {fmt!r} serves {served.kind} drafts, not a {drafter.kind} drafter")
    if exit_threshold is not None and head is None:
        raise ExportError("--exit-threshold needs an accept head (the checkpoint has no head.safetensors)")
    ids = [int(i) for i in drafter.config.target_layer_ids]
    if len(set(ids)) != len(ids):
        raise ExportError(f"the draft reads layer ids {ids} with a repeat; the engines capture each layer once")
    served.check_exportable(drafter)
    try:
        dtype = dtype_name(dtype or next(drafter.parameters()).dtype)
    except ValueError as e:
        raise ExportError(str(e)) from None
    cfg = served.build_config(drafter, target, dtype, k=k, verifier=verifier, mask_token_id=mask_token_id)
    state = {name: (v.to(DTYPES[dtype]) if v.is_floating_point() else v).detach().cpu().contiguous()
             for name, v in served.served_state(drafter, target).items()}

    def write(folder: Path) -> None:
        (folder / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(state, folder / WEIGHTS, metadata={"format": "pt"})
        user_mode(folder / WEIGHTS)  # an engine in a container runs as another user
        (folder / RECORD).write_text(strict_json(make_record(drafter, target, training, template), indent=2) + "\n")
        write_card(folder, fmt, target.path, k or drafter.k, Path(out))  # a launch flag for a format without k
        served.write_files(folder, drafter, cfg, dtype)
        if head is not None:
            _write_head(folder / HEAD_DIR, head, drafter, exit_threshold)
        validate_export(folder, target)

    return _write_atomically(Path(out), write, force=force)


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

