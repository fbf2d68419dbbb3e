"""Open any draft on disk: a training checkpoint, a run folder or an exported served draft.

    drafter, head = open_draft("runs/e3-vat", target)      # or a checkpoint, or an export folder

It sits above ``checkpoint`` (training checkpoints) and ``export`` (served formats), so neither
imports the other to open a draft.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vatspec.checkpoint import CheckpointError, load_checkpoint_draft, resolve_checkpoint
from vatspec.drafters.base import AcceptHead
from vatspec.export.formats import HEAD_DIR
from vatspec.export.read import import_draft, load_accept_head


def open_draft(path: str | Path, target, *, device: str | torch.device | None = None,
               k: int | None = None) -> tuple[torch.nn.Module, AcceptHead | None]:
    """The one way a command opens a draft -> ``(drafter, head | None)``, attached to ``target``, in eval mode.

    path:      a training checkpoint (``drafter.safetensors``), a run folder (``latest`` names its newest
               checkpoint) or an exported served draft (``config.json`` in any format of ``vatspec.export``,
               ours or third-party; its accept head from ``accept_head/`` when there is one).
    device:    default: the target's.
    k:         EAGLE-3 only: replaces the draft's k (its TTT unroll length), e.g. the run's own
               ``drafter.ttt_steps`` when fine-tuning a published draft (``vatspec train --init-from``).
    Raises ``CheckpointError`` (``vatspec.export.ExportError``, a subclass, for a served folder) and
    nothing else when ``path`` holds no draft or one that does not fit ``target``.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p} does not exist")
    device = device or target.device
    if (p / "drafter.safetensors").is_file() or (p / "latest").is_file():
        return load_checkpoint_draft(resolve_checkpoint(p), target, device, k)
    if (p / "config.json").is_file():
        drafter = import_draft(p, target, k=k, device=device)
        head = load_accept_head(p, device=device)[0] if (p / HEAD_DIR).is_dir() else None
        return drafter, head
    raise CheckpointError(f"{p} is neither a training checkpoint (drafter.safetensors), a run folder (latest) "
                          "nor an exported draft (config.json)")
