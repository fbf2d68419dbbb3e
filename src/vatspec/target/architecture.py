"""What a target is made of, said when it is opened (``summary(target)``, ``describe(target)``).

A draft trainer that reads a target generically must still say what it found, before hours of work: the kinds of
decoder layer (full, sliding or chunked attention, linear attention / SSM / convolution, MoE, MLA), the layers
the drafters read, how verification takes the cache back (``vatspec.target.rollback``), the RoPE scaling, the
transforms the model applies to its logits, and whether the serving engines run EAGLE-3 and DFlash drafts for
the architecture at all (``engine_support.json``, read from the engines' own sources by
``tools/engine_support.py``).
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

__all__ = ["describe", "engine_support", "layer_kinds", "summary"]

# transformers' ``layer_types`` names -> what the summary calls them
KIND_NAMES = {
    "full_attention": "attention",
    "sliding_attention": "sliding window",
    "chunked_attention": "chunked attention",
    "linear_attention": "linear attention / SSM",
    "conv": "short convolution",
    "hybrid": "attention + SSM in parallel",
    "mlp": "MLP only",
    "moe": "MoE only",
}


def layer_kinds(config) -> dict[str, int]:
    """Decoder layers by kind, ``{name: count}``, from the config (``layer_types`` where the family writes it)."""
    types = getattr(config, "layer_types", None)
    if not isinstance(types, (list, tuple)):
        window = getattr(config, "sliding_window", None)
        types = ["sliding_attention" if window else "full_attention"] * int(config.num_hidden_layers)
    kinds: dict[str, int] = {}
    for t in types:
        name = KIND_NAMES.get(t, t)
        kinds[name] = kinds.get(name, 0) + 1
    return kinds


def _window(config) -> str | None:
    """``window N`` / ``chunk N`` of the attention layers that see only part of the context; None for none."""
    parts = []
    if getattr(config, "sliding_window", None):
        parts.append(f"window {config.sliding_window}")
    if getattr(config, "attention_chunk_size", None):
        parts.append(f"chunk {config.attention_chunk_size}")
    return ", ".join(parts) or None


def _experts(config) -> int:
    types = getattr(config, "layer_types", None) or []
    if "mlp" in types and "moe" not in types:  # a family that names its block kinds (Nemotron-H): no MoE block
        return 0
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        n = getattr(config, key, None)
        if isinstance(n, int) and n > 1:
            return n
    return 0


@cache
def engine_support() -> dict:
    """``engine_support.json``: per engine, its version and the architectures whose targets it runs EAGLE-3 and
    DFlash drafts for."""
    return json.loads(resources.files("vatspec.target").joinpath("engine_support.json").read_text())


def _engines(architectures: list[str]) -> dict[str, dict[str, bool]]:
    """Per engine, per drafter kind (the table's keys): whether it serves that kind's drafts for these."""
    from vatspec.drafters import DRAFTERS

    table = engine_support()
    return {f"{engine} {info['version']}": {m: any(a in info.get(m, []) for a in architectures) for m in DRAFTERS}
            for engine, info in table.items() if isinstance(info, dict) and "version" in info}


def _runs_forward(target) -> bool:
    """Whether the target's decoder layers hold weights (not opened on ``meta`` or heads only)."""
    p = next(iter(target._layers.parameters()), None)
    return p is not None and p.device.type != "meta"


def _served_architectures(target) -> list[str]:
    """The folder's ``config.json`` architectures, what an engine reads (a multimodal wrapper's, not the text
    model's that transformers opens); [] without a folder."""
    from pathlib import Path

    file = Path(target.path) / "config.json" if target.path else None
    try:
        return list(json.loads(file.read_text()).get("architectures") or []) if file else []
    except (OSError, ValueError):
        return []


def _logits(config) -> list[str]:
    """What the model's forward does to ``lm_head(hidden)`` (``families.logit_transform``), in words."""
    from vatspec.target.families import logit_transform

    scale, cap = logit_transform(config)
    return ([f"x {scale:g}"] if scale != 1.0 else []) + ([f"soft-cap {cap:g}"] if cap else [])


def _ids(default) -> list[int] | None:
    """The drafter's default layer ids, None where the target is too shallow for them (they must be set)."""
    try:
        return list(default())
    except ValueError:
        return None


def summary(target) -> dict:
    """The target's architecture as a dict (``describe`` prints it)."""
    from vatspec.drafters import DRAFTERS
    from vatspec.drafters.layers import rope_parameters
    from vatspec.target.rollback import plan

    cfg = target.config
    full_cfg = target.model.config
    archs = _served_architectures(target) or list(getattr(full_cfg, "architectures", None) or
                                                  [type(target.model).__name__])
    _, scaling = rope_parameters(cfg)
    out = {
        "model_type": getattr(full_cfg, "model_type", None),
        "architectures": archs,
        "layers": target.num_layers,
        "kinds": layer_kinds(cfg),
        "window": _window(cfg),
        "experts": _experts(cfg),
        "mla": bool(getattr(cfg, "kv_lora_rank", None)),
        **{f"{kind}_layer_ids": _ids(lambda cls=cls: cls.default_layer_ids(target.num_layers))
           for kind, cls in DRAFTERS.items()},  # a one-layer draft's
        "rope_scaling": (scaling or {}).get("rope_type"),
        "logits": _logits(cfg),
        "rollback": plan(target).describe() if _runs_forward(target) else None,
        "engines": _engines(archs),
    }
    return out


def describe(target) -> list[str]:
    """The summary in a few lines, for the commands to print when they open a target."""
    from vatspec.drafters import DRAFTERS

    s = summary(target)
    kinds = ", ".join(f"{n} x{c}" for n, c in s["kinds"].items())
    extra = [f"{s['experts']} experts"] if s["experts"] else []
    extra += ["MLA"] if s["mla"] else []
    lines = [f"target {'/'.join(s['architectures'])}: {s['layers']} layers: {kinds}"
             + (f" ({s['window']})" if s["window"] else "") + (f"; {', '.join(extra)}" if extra else "")]
    read = ", ".join(f"{cls.title} {s[f'{kind}_layer_ids'] or 'none by default (too shallow)'}"
                     for kind, cls in DRAFTERS.items())
    lines.append(f"  drafters read layers: {read} (default)"
                 f"; RoPE {s['rope_scaling'] or 'plain'}; logits: {', '.join(s['logits']) or 'lm_head only'}")
    if s["rollback"]:
        lines.append(f"  verification takes the cache back by: {s['rollback']}")
    served = []
    for engine, methods in s["engines"].items():
        said = ", ".join(f"{DRAFTERS[m].title} {'yes' if ok else 'no'}" for m, ok in methods.items())
        served.append(f"{engine}: {said}")
    if served:
        lines.append("  engines serve drafts for it: " + "; ".join(served))
    return lines
