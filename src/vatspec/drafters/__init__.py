"""Drafters: each kind is a folder implementing ``Drafter`` (``base.py``: its config, training forward, decode
session, batch plan, served formats), listed in ``DRAFTERS`` under its ``kind``. The training loop's calls::

    drafter = build_drafter(cfg.drafter, target, token_counts)
    plan = plan_batch(drafter, batch, cfg.drafter, generator)   # what the target must compute
    tout = target(batch.input_ids, batch.attention_mask, drafter.target_layer_ids, logits_at=plan.logits_at)
    out = drafter.training_forward(batch, tout, **plan.kwargs)   # -> DraftOutput, k positions per chain

Adding a drafter is one folder (and its tests) plus its line in ``DRAFTERS``: no code outside ``drafters/``
asks which kind it holds. Outside the folder go only settings of its own, as ``DrafterConfig`` fields
(``config.py``, each tagged with its kind in its metadata, like ``EAGLE3_ONLY``), and a new loss schedule, whose
curve goes in ``objective/terms.py`` (``SCHEDULES``, ``_base_curve``). What the kinds share: ``layers.py``
(RMSNorm, RoPE, the MLP, attention), ``vocab.py`` (a reduced draft vocabulary), ``sampling.py`` (a round's
proposal), ``served.py`` (served formats).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from vatspec.drafters.base import Drafter, DrafterPlan
from vatspec.drafters.dflash import DFlashDrafter
from vatspec.drafters.eagle3 import DEFAULT_TTT_STEPS, Eagle3Drafter
from vatspec.drafters.served import ServedFormat

DRAFTERS: dict[str, type[Drafter]] = {cls.kind: cls for cls in (Eagle3Drafter, DFlashDrafter)}


class RegistryView(Mapping):
    """A read-only mapping built from ``DRAFTERS`` each time it is read, so that a kind registered after import
    (``DRAFTERS[kind] = cls``) is in it."""

    def __init__(self, build: Callable[[], dict]):
        self._build = build

    def __getitem__(self, key: str) -> Any:
        return self._build()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._build())

    def __len__(self) -> int:
        return len(self._build())

    def __repr__(self) -> str:
        return repr(self._build())


# every served format by its name (--format), the kinds' own in order
SERVED_FORMATS: Mapping[str, ServedFormat] = RegistryView(
    lambda: {f.name: f for cls in DRAFTERS.values() for f in cls.formats})

__all__ = ["DEFAULT_TTT_STEPS", "DRAFTERS", "SERVED_FORMATS", "Drafter", "DrafterPlan", "RegistryView",
           "build_drafter", "check_kind", "drafter_class", "drafter_from_dict", "plan_batch"]


def check_kind(kind: str, source: str = "drafter.kind") -> None:
    if kind not in DRAFTERS:
        raise ValueError(f"{source}: drafter.kind {kind!r} is not one of {', '.join(DRAFTERS)}")


def drafter_class(kind: str, source: str = "drafter.kind") -> type[Drafter]:
    """The drafter class registered for ``kind``: the kind's answers before there is a drafter."""
    check_kind(kind, source)
    return DRAFTERS[kind]


def build_drafter(cfg, target, token_counts: Tensor | None = None) -> Drafter:
    """A freshly initialised drafter for ``target`` from a ``DrafterConfig``."""
    return drafter_class(cfg.kind).build(cfg, target, token_counts)


def drafter_from_dict(kind: str, config: dict, target, *, source: str = "drafter.json",
                      k: int | None = None) -> Drafter:
    """Rebuild a drafter from its saved config and check it fits ``target``. ``k``: the drafted length, where it
    is a setting (``Drafter.config_with_k``)."""
    cls = drafter_class(kind, source)
    conf = cls.config_class.from_dict(config if k is None else cls.config_with_k(config, k))
    checks = {
        "vocab_size": target.vocab_size,
        "target_hidden_size": target.hidden_size,
    }
    for name, want in checks.items():
        have = getattr(conf, name, None)
        if have is not None and have != want:
            raise ValueError(f"{source}: {name}={have} does not match the target ({want})")
    for i in conf.target_layer_ids:
        if not 0 <= i < target.num_layers:
            raise ValueError(f"{source}: target layer id {i} out of range for a {target.num_layers}-layer target")
    drafter = cls(conf)
    drafter.attach_target(target)
    return drafter


def plan_batch(drafter: Drafter, batch, cfg, generator: torch.Generator | None, *,
               with_logits: bool = True) -> DrafterPlan:
    """What the target must compute for ``batch`` and ``training_forward``'s keyword arguments
    (``Drafter.plan_batch``). ``with_logits=False``: the drafter returns its hidden state and lm_head instead
    of logits (the chunked loss path, ``vatspec.objective.chunked``)."""
    return drafter.plan_batch(batch, cfg, generator, with_logits=with_logits)
