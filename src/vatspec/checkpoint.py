"""Checkpoints: written atomically, loadable for resume and for decoding; ``open_draft`` opens any draft.

Layout of one checkpoint folder (``RUN/checkpoints/step-000100``)::

    drafter.safetensors   drafter weights (no target embedding / lm_head: those stay the target's)
    drafter.json          {"kind": ..., "config": {...}} to rebuild the drafter class
    head.safetensors      the accept head, when trained (never part of a served draft)
    config.yaml           the resolved run config
    trainer.safetensors   the trainer state's tensors (optimizer moments, RNG states)
    trainer.json          the rest of the trainer state (step, scheduler, data position, metrics), with
                          each tensor replaced by its key in trainer.safetensors

Nothing in a checkpoint is unpickled: a run folder received from someone else runs no code when
it is resumed.

A checkpoint is first written to ``step-XXXXXX.tmp-PID`` and renamed when complete; ``RUN/latest``
(replaced atomically) names the newest one. A killed run leaves at worst a ``.tmp-*`` folder,
which loaders ignore and the next save removes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from vatspec.drafters.errors import CheckpointError
from vatspec.outputs import WRITE_ERRORS, user_mode, write_error

if TYPE_CHECKING:  # the drafters' served formats raise a CheckpointError: they import this module, not the reverse
    from vatspec.drafters.base import AcceptHead


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    drafter: torch.nn.Module,
    head: AcceptHead | None,
    config_yaml: str,
    trainer_state: dict | None = None,
    keep: int = 0,
    name: str | None = None,
    drafter_state: dict | None = None,
    head_state: dict | None = None,
) -> Path:
    """Write one checkpoint atomically and point ``RUN/latest`` at it; keep the newest ``keep``.
    ``drafter_state`` / ``head_state`` replace the modules' own state dicts (sharded training gathers them)."""
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / (name or f"step-{step:06d}")
    tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
    try:
        _write_parts(tmp, step, drafter, head, config_yaml, trainer_state, drafter_state, head_state)
    except WRITE_ERRORS as e:  # a full disk, a quota: nothing half-written is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{final}: the checkpoint could not be written ({write_error(e)}); its partial files are "
                              "removed, the earlier checkpoints are as they were") from e
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write_text(run_dir / "latest", final.name + "\n")
    if keep > 0:
        steps = sorted(p for p in root.glob("step-*") if ".tmp-" not in p.name)
        for old in steps[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def _write_parts(tmp: Path, step, drafter, head, config_yaml, trainer_state, drafter_state, head_state) -> None:
    """The files of one checkpoint, into the folder ``tmp`` (renamed into place once complete)."""
    tmp.mkdir()
    state = {k: v.detach().cpu().contiguous() for k, v in (drafter_state or drafter.state_dict()).items()}
    save_file(state, tmp / "drafter.safetensors")
    user_mode(tmp / "drafter.safetensors")
    (tmp / "drafter.json").write_text(
        json.dumps({"kind": drafter.kind, "config": drafter.config.to_dict()}, indent=2)
    )
    if head is not None:
        hs = {k: v.detach().cpu().contiguous() for k, v in (head_state or head.state_dict()).items()}
        save_file(hs, tmp / "head.safetensors")
        user_mode(tmp / "head.safetensors")
    (tmp / "config.yaml").write_text(config_yaml)
    if trainer_state is not None:
        tensors: dict[str, torch.Tensor] = {}
        tree = _encode({"step": step, **trainer_state}, tensors, "")
        save_file(tensors, tmp / "trainer.safetensors")
        user_mode(tmp / "trainer.safetensors")
        (tmp / "trainer.json").write_text(json.dumps(tree))


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder (-> its latest checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if (path / "drafter.safetensors").is_file():
        return path
    latest = path / "latest"
    if latest.is_file():
        ckpt = path / "checkpoints" / latest.read_text().strip()
        if (ckpt / "drafter.safetensors").is_file():
            return ckpt
        raise CheckpointError(f"{latest} names {ckpt}, which is missing or incomplete")
    raise CheckpointError(f"{path} is neither a checkpoint (no drafter.safetensors) nor a run folder (no latest)")


def load_checkpoint_draft(ckpt: Path, target, device, k: int | None = None):
    """A training checkpoint folder -> ``(drafter, head | None)`` on ``device``, in eval mode."""
    from vatspec.drafters import drafter_from_dict
    from vatspec.drafters.base import AcceptHead

    try:
        meta = json.loads((ckpt / "drafter.json").read_text())
        kind, config = meta["kind"], dict(meta["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{ckpt / 'drafter.json'}: unreadable ({e!r}); expected {{kind, config}}") from e
    try:  # k replaces the drafter's where it is a setting (EAGLE-3's unroll), not where the weights fix it
        drafter = drafter_from_dict(kind, config, target, source=str(ckpt / "drafter.json"), k=k)
    except (ValueError, TypeError) as e:
        raise CheckpointError(str(e)) from e
    try:
        drafter.load_state_dict(load_file(ckpt / "drafter.safetensors"), strict=True)
    except (RuntimeError, OSError, SafetensorError) as e:
        raise CheckpointError(f"{ckpt}/drafter.safetensors is unreadable or does not fit the drafter config: "
                              f"{e}") from e
    head = None
    if (ckpt / "head.safetensors").is_file():
        head = AcceptHead(drafter.hidden_size, label=_head_label(ckpt))
        try:
            head.load_state_dict(load_file(ckpt / "head.safetensors"))
        except (RuntimeError, OSError, SafetensorError) as e:
            raise CheckpointError(f"{ckpt}/head.safetensors is unreadable or does not fit the drafter: {e}") from e
        head.to(device).eval()
    return drafter.to(device).eval(), head


def _head_label(ckpt: Path) -> str:
    """What the checkpoint's head was trained on (``loss.head_label`` of its ``config.yaml``): "alive"
    (VAT) or "alpha" (DSpark's confidence head); "alive" for a checkpoint older than the field."""
    from vatspec.drafters.base import HEAD_RULES

    if not (ckpt / "config.yaml").is_file():
        return "alive"
    try:
        loss = yaml.safe_load((ckpt / "config.yaml").read_text()).get("loss") or {}
    except (OSError, AttributeError, yaml.YAMLError) as e:
        raise CheckpointError(f"{ckpt / 'config.yaml'}: unreadable ({e}); it says what the accept head predicts") from e
    label = loss.get("head_label") or "alive"
    if label not in HEAD_RULES:
        raise CheckpointError(f"{ckpt / 'config.yaml'}: loss.head_label {label!r} is not one of {tuple(HEAD_RULES)}")
    return label


def saved_config(path: str | Path):
    """The resolved run config saved in a checkpoint (or a run folder's latest checkpoint)."""
    from vatspec.config import ConfigError, load_config

    file = resolve_checkpoint(path) / "config.yaml"
    if not file.is_file():
        raise CheckpointError(f"{file} is missing")
    try:
        return load_config(file)
    except ConfigError as e:
        raise CheckpointError(str(e)) from e


def load_trainer_state(ckpt: Path) -> dict:
    """The trainer state saved in checkpoint ``ckpt`` (``trainer.json`` + ``trainer.safetensors``)."""
    meta, tensors = ckpt / "trainer.json", ckpt / "trainer.safetensors"
    if not meta.is_file():
        raise CheckpointError(f"{meta} is missing: cannot resume from {ckpt}")
    try:
        tree = json.loads(meta.read_text(encoding="utf-8"))
        return _decode(tree, load_file(tensors) if tensors.is_file() else {}, str(meta))
    except (OSError, ValueError, SafetensorError, KeyError, TypeError) as e:
        raise CheckpointError(f"{meta}: unreadable trainer state ({e}); cannot resume from {ckpt}") from e


# A trainer state is a tree of dicts, lists, tuples, numbers, strings, tensors and numpy arrays. It is
# saved as JSON with every tensor (and array) moved to a safetensors file under its path in the tree:
#   {"state": {0: {"exp_avg": <tensor>}}, "betas": (0.9, 0.95)}
#   -> {"state": {"__dict__": [[0, {"exp_avg": {"__tensor__": "state.0.exp_avg"}}]]},
#       "betas": {"__tuple__": [0.9, 0.95]}}
# Dicts with a key that is not a string (the optimizer's parameter indices) keep their key types.
def _encode(obj, tensors: dict, path: str):
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().cpu().clone().contiguous()
        return {"__tensor__": path}
    if isinstance(obj, np.ndarray):
        tensors[path] = torch.from_numpy(obj.astype(np.int64) if obj.dtype == np.uint32 else obj.copy())
        return {"__ndarray__": path, "dtype": str(obj.dtype)}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors, f"{path}.{k}" if path else k) for k, v in obj.items()}
        return {"__dict__": [[k, _encode(v, tensors, f"{path}.{k}")] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"trainer state at {path!r}: cannot save a {type(obj).__name__} without pickle")


def _decode(obj, tensors: dict, where: str):
    if isinstance(obj, list):
        return [_decode(v, tensors, where) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return tensors[obj["__ndarray__"]].numpy().astype(obj["dtype"])
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors, where) for v in obj["__tuple__"])
    if "__dict__" in obj:
        return {k: _decode(v, tensors, where) for k, v in obj["__dict__"]}
    return {k: _decode(v, tensors, where) for k, v in obj.items()}
