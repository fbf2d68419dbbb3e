"""``pilot_arms.py`` with EAGLE-3 drafters whose ``fc`` reads its input rescaled by fixed factors measured
on the feature cache: every arm whose name ends in ``_dimscale`` (one factor per feature dimension) or
``_layerscale`` (one per target layer) is built as usual, then its ``fc`` multiplies the fused features
by 1 / RMS before the matrix; the other arms are untouched (same batches, same seed).

    .venv/bin/python scripts/pilot_fc_scale.py OUT STEPS EVAL_EVERY "COMMON OVERRIDES" NAME="OVERRIDES" ...

Why: the captured layers differ in scale (on the demo's data the median token RMS of layers 1, 14 and 26 is
2.7, 6.3 and 22.9) and the first token of every sequence reaches RMS ~1000 in layers 14 and 26, so the deepest
layer and a handful of dimensions dominate ``fc``'s input and its gradient. A fixed diagonal factor could be
folded into ``fc.weight`` at export (``W' = W diag(s)``; no export code does it), so such a draft would serve
unchanged; only the optimisation differs. The RMS leaves out rows above 4x the median token RMS (those first
tokens).

Measured with it: docs/results.md, "Drafter architecture: EAGLE-3's target layers and fc's input scale,
DFlash's depth". Not a training option: neither factor helped.
"""

import runpy
import shlex
import sys
from pathlib import Path

import torch

import vatspec.train as train
from vatspec.features.reader import FeatureCache

_build = train.build_drafter


class ScaledLinear(torch.nn.Linear):
    """``Linear`` without bias whose input is multiplied by the fixed buffer ``in_scale`` first."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x * self.in_scale.to(x.dtype), self.weight)


def feature_rms(cache: Path, layer_ids, per: str) -> torch.Tensor:
    """[len(layer_ids) * H] RMS of each fused input dimension (``per="dim"``) or of each layer's block."""
    fcache = FeatureCache(cache)
    feats = torch.cat([fcache.read(row, layer_ids)[0] for row in range(len(fcache))]).float()
    out = []
    for x in feats.chunk(len(layer_ids), dim=-1):
        tok = x.pow(2).mean(-1).sqrt()
        x = x[tok < 4 * tok.median()]
        rms = x.pow(2).mean(0).sqrt() if per == "dim" else x.pow(2).mean().sqrt().expand(x.shape[1])
        out.append(rms.clamp_min(1e-3))
    return torch.cat(out)


def build_drafter(cfg, target, counts=None):
    drafter = _build(cfg, target, counts)
    per = _scale.pop(0)
    if per:
        if drafter.kind != "eagle3" or not _cache:
            raise SystemExit("pilot_fc_scale: scaled arms need drafter.kind=eagle3 and data.features=... in COMMON")
        fc = drafter.fc
        scaled = ScaledLinear(fc.in_features, fc.out_features, bias=False)
        scaled.weight = fc.weight
        rms = feature_rms(Path(_cache), drafter.target_layer_ids, per)
        scaled.register_buffer("in_scale", (1.0 / rms).to(fc.weight.device))
        drafter.fc = scaled
    return drafter


if __name__ == "__main__":
    # train_arms builds the arms in command-line order: one entry per arm
    names = [a.partition("=")[0] for a in sys.argv[5:]]
    _scale = ["dim" if n.endswith("_dimscale") else "layer" if n.endswith("_layerscale") else "" for n in names]
    _cache = next((o.partition("=")[2] for o in shlex.split(sys.argv[4]) if o.startswith("data.features=")), "")
    train.build_drafter = build_drafter
    sys.argv[0] = str(Path(__file__).with_name("pilot_arms.py"))
    runpy.run_path(sys.argv[0], run_name="__main__")
