"""The reduced draft vocabulary of EAGLE-3: the most frequent target ids, and the two maps.

    d2t [Vd] long: an offset per draft id, ``target_id = i + d2t[i]`` (the served HF format)
    t2d [V]  bool: True for the target ids that have a draft id

Example (V = 6, size = 3): counts = [0, 5, 2, 5, 0, 1] -> ids 1, 3 (count 5, ties by id), 2
-> sorted [1, 2, 3] -> d2t = [1, 1, 1], t2d = [F, T, T, T, F, F].
"""

from __future__ import annotations

import torch
from torch import Tensor


def build_draft_vocab(counts: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """The ``size`` most frequent target ids (ties broken by the lower id), sorted ascending.

    counts: [V] integer counts per target id (e.g. of the supervised tokens of the training data).
    size:   draft vocabulary size; capped by V. When fewer than ``size`` ids were seen, ids with
            count 0 fill the rest in ascending id order, so the result is deterministic.
    Returns ``(d2t [Vd] long, t2d [V] bool)`` with ``Vd = min(size, V)``.
    """
    if counts.dim() != 1 or counts.numel() == 0:
        raise ValueError(f"counts must be a non-empty [V] tensor, got shape {tuple(counts.shape)}")
    if counts.is_floating_point() or counts.is_complex():
        raise ValueError(f"counts must be integer counts, got dtype {counts.dtype}")
    if size < 1:
        raise ValueError(f"draft vocabulary size must be >= 1, got {size}")
    if bool((counts < 0).any()):
        raise ValueError("counts must be >= 0")
    V = counts.numel()
    Vd = min(size, V)
    counts = counts.detach().to("cpu", torch.long)
    # A stable descending sort keeps equal counts in ascending id order: ties go to the lower id,
    # and zero-count ids come last, also by id.
    order = torch.sort(counts, descending=True, stable=True).indices  # [V]
    ids = order[:Vd].sort().values  # [Vd] ascending target ids
    d2t = ids - torch.arange(Vd, dtype=torch.long)  # [Vd]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def target_ids(d2t: Tensor) -> Tensor:
    """The target id of every draft id: ``arange(Vd) + d2t`` -> [Vd] long."""
    return torch.arange(d2t.numel(), device=d2t.device, dtype=torch.long) + d2t.long()


def check_draft_vocab(d2t: Tensor, t2d: Tensor) -> None:
    """Raise ``ValueError`` unless ``d2t`` and ``t2d`` describe the same ascending id set."""
    if d2t.dim() != 1 or t2d.dim() != 1:
        raise ValueError(f"d2t must be [Vd] and t2d [V], got {tuple(d2t.shape)} and {tuple(t2d.shape)}")
    if d2t.dtype != torch.long or t2d.dtype != torch.bool:
        raise ValueError(f"d2t must be int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    ids = target_ids(d2t).cpu()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t2d.numel()):
        raise ValueError(f"d2t maps outside the target vocabulary [0, {t2d.numel()})")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("d2t target ids must be strictly ascending")
    if not torch.equal(t2d.cpu().nonzero().squeeze(-1), ids):
        raise ValueError("t2d does not mark exactly the target ids of d2t")
