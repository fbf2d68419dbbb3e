"""Checkpoints: written atomically, loadable for resume and for decoding; ``open_draft`` opens any draft.

Layout of one checkpoint folder (``RUN/checkpoints/step-000100``)::

    drafter.safetensors   drafter weights (no target embedding / lm_head: those stay the target's)
    drafter.json          {"kind": ..., "config": {...}} to rebuild the drafter class
    head.safetensors      the accept head, when trained (never part of a served draft)
    config.yaml           the resolved run config
    trainer.pt            optimizer, scheduler, RNG states, data position, step, metrics

A checkpoint is first written to ``step-XXXXXX.tmp-PID`` and renamed when complete; ``RUN/latest``
(replaced atomically) names the newest one. A killed run leaves at worst a ``.tmp-*`` folder,
which loaders ignore and the next save removes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from vatspec.drafters.base import AcceptHead


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the target."""


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
) -> Path:
    """Write one checkpoint atomically and point ``RUN/latest`` at it; keep the newest ``keep``."""
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / (name or f"step-{step:06d}")
    tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
    tmp.mkdir()
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, tmp / "drafter.safetensors")
    (tmp / "drafter.json").write_text(
        json.dumps({"kind": drafter.kind, "config": drafter.config.to_dict()}, indent=2)
    )
    if head is not None:
        hs = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
        save_file(hs, tmp / "head.safetensors")
    (tmp / "config.yaml").write_text(config_yaml)
    if trainer_state is not None:
        torch.save({"step": step, **trainer_state}, tmp / "trainer.pt")
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

    try:
        meta = json.loads((ckpt / "drafter.json").read_text())
        kind, config = meta["kind"], dict(meta["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{ckpt / 'drafter.json'}: unreadable ({e!r}); expected {{kind, config}}") from e
    if k is not None and kind == "eagle3":
        config["ttt_steps"] = int(k)  # an unroll length: no parameter depends on it
    try:
        drafter = drafter_from_dict(kind, config, target, source=str(ckpt / "drafter.json"))
    except (ValueError, TypeError) as e:
        raise CheckpointError(str(e)) from e
    try:
        drafter.load_state_dict(load_file(ckpt / "drafter.safetensors"), strict=True)
    except (RuntimeError, OSError, SafetensorError) as e:
        raise CheckpointError(f"{ckpt}/drafter.safetensors is unreadable or does not fit the drafter config: "
                              f"{e}") from e
    head = None
    if (ckpt / "head.safetensors").is_file():
        head = AcceptHead(drafter.hidden_size)
        try:
            head.load_state_dict(load_file(ckpt / "head.safetensors"))
        except (RuntimeError, OSError, SafetensorError) as e:
            raise CheckpointError(f"{ckpt}/head.safetensors is unreadable or does not fit the drafter: {e}") from e
        head.to(device).eval()
    return drafter.to(device).eval(), head


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
    path = ckpt / "trainer.pt"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: cannot resume from {ckpt}")
    return torch.load(path, map_location="cpu", weights_only=False)
