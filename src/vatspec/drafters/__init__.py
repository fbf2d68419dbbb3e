"""Drafters: a plain registry, and the two calls the training loop makes on any of them.

    drafter = build_drafter(cfg.drafter, target, token_counts)
    plan = plan_batch(drafter, batch, cfg.drafter, generator)   # what the target must compute
    tout = target(batch.input_ids, batch.attention_mask, drafter.target_layer_ids, logits_at=plan.logits_at)
    out = drafter.training_forward(batch, tout, **plan.kwargs)   # -> DraftOutput, k positions per chain
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch
from torch import Tensor

DEFAULT_TTT_STEPS = 7  # the reference unroll: k = 7 drafted positions per chain in training and per decode round

# kind -> (module, drafter class, config class)
DRAFTERS: dict[str, tuple[str, str, str]] = {
    "eagle3": ("vatspec.drafters.eagle3", "Eagle3Drafter", "Eagle3Config"),
    "dflash": ("vatspec.drafters.dflash", "DFlashDrafter", "DFlashConfig"),
}


def check_kind(kind: str, source: str = "drafter.kind") -> None:
    if kind not in DRAFTERS:
        raise ValueError(f"{source}: drafter.kind {kind!r} is not one of {', '.join(DRAFTERS)}")


def _classes(kind: str, source: str = "drafter.kind"):
    check_kind(kind, source)
    mod, cls, cfg = DRAFTERS[kind]
    module = importlib.import_module(mod)
    return getattr(module, cls), getattr(module, cfg)


def drafter_class(kind: str, source: str = "drafter.kind") -> type:
    """The drafter class registered for ``kind`` (its ``schedule`` names its loss curve)."""
    return _classes(kind, source)[0]


@dataclass
class DrafterPlan:
    """What one micro-batch needs: where the target must produce logits (None = everywhere)
    and the extra keyword arguments of ``training_forward`` (DFlash's anchors)."""

    logits_at: Tensor | None = None  # bool [B, T]
    kwargs: dict = field(default_factory=dict)
    target_logits: bool = True  # False: the chunked path computes them from the target's hidden state


def build_drafter(cfg, target, token_counts: Tensor | None = None):
    """A freshly initialised drafter for ``target`` from a ``DrafterConfig``."""
    cls, conf_cls = _classes(cfg.kind)
    layer_ids = list(cfg.target_layer_ids) if cfg.target_layer_ids else None
    if cfg.kind == "eagle3":
        from vatspec.drafters.vocab import build_draft_vocab

        drafter = cls.from_target(
            target, draft_vocab_size=cfg.draft_vocab_size, ttt_steps=cfg.ttt_steps, target_layer_ids=layer_ids
        )
        if token_counts is None:
            token_counts = torch.ones(target.vocab_size, dtype=torch.long)
        drafter.set_vocab(*build_draft_vocab(token_counts, drafter.config.draft_vocab_size))
        if cfg.init_lm_head:
            init_lm_head_from_target(drafter, target)
        return drafter
    conf = conf_cls.from_target(
        target, num_layers=cfg.num_layers, block_size=cfg.block_size, target_layer_ids=layer_ids,
        mask_token_id=cfg.mask_token_id,
    )
    drafter = cls(conf)
    drafter.attach_target(target)
    return drafter


@torch.no_grad()
def init_lm_head_from_target(drafter, target) -> None:
    """EAGLE-3 option: copy the target's output rows of the draft vocabulary into ``lm_head`` and
    the target's final norm into ``norm``, so the draft starts in the target's output space.
    (The reference initialises both randomly, and so does this project by default: on SmolLM2 this
    start learned slower than random; docs/results.md, "Every lever at a glance".)"""
    from vatspec.drafters.vocab import target_ids

    rows = target_ids(drafter.d2t)
    drafter.lm_head.weight.copy_(target.lm_head.weight[rows.to(target.lm_head.weight.device)])
    final_norm = getattr(getattr(target.model, "model", None), "norm", None)
    gemma_style = str(getattr(target.config, "model_type", "")).startswith("gemma")  # (1 + w) norms
    if final_norm is not None and not gemma_style and final_norm.weight.shape == drafter.norm.weight.shape:
        drafter.norm.weight.copy_(final_norm.weight)


def drafter_from_dict(kind: str, config: dict, target, *, source: str = "drafter.json"):
    """Rebuild a drafter from its saved config and check it fits ``target``."""
    cls, conf_cls = _classes(kind, source)
    conf = conf_cls.from_dict(config)
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


def plan_batch(drafter, batch, cfg, generator: torch.Generator | None, *, with_logits: bool = True) -> DrafterPlan:
    """EAGLE-3 needs target logits everywhere; DFlash samples anchors and needs logits only
    at the positions its blocks predict. ``with_logits=False``: the drafter returns its hidden state
    and lm_head instead of logits (the chunked loss path, ``vatspec.objective.chunked``)."""
    kwargs = {} if with_logits else {"with_logits": False}
    if drafter.kind == "dflash":
        anchors = drafter.sample_anchors(batch, cfg.num_anchors, generator)
        return DrafterPlan(logits_at=drafter.logits_positions(batch, anchors), kwargs={"anchors": anchors, **kwargs},
                           target_logits=with_logits)
    return DrafterPlan(kwargs=kwargs, target_logits=with_logits)
