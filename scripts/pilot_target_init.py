"""``pilot_arms.py`` with drafters that start from the target's weights: every arm whose name ends in
``_tinit`` is built as usual, then overwritten as below; the other arms are untouched (same batches,
same seed), so each ``_tinit`` arm is read against its random-init twin.

    .venv/bin/python scripts/pilot_target_init.py OUT STEPS EVAL_EVERY "COMMON OVERRIDES" NAME="OVERRIDES" ...

With L the deepest target layer the drafter reads (this project's ids: L = output of decoder layer L):

- EAGLE-3: lm_head and final norm from the target (``drafter.init_lm_head``); ``fc`` passes layer L
  through (identity on its block, zero on the others); the decoder layer from target layer L + 1
  (the hidden half of q/k/v, o_proj, the MLP and the norms; the embedding half of q/k/v zero).
- DFlash: ``fc`` passes layer L through; the context norm is target layer L + 1's input norm, so
  the context keys and values are that layer's own (up to the per-head k_norm, which the target
  lacks: left at ones); draft layer j from target layer L + 1 + j; the final norm from the target.

Measured with it: docs/results.md, "What each training lever bought". Not a training option: no
start from the target's weights helped, so none is in ``vatspec train``.
"""

import runpy
import sys
from pathlib import Path

import torch

import vatspec.train as train
from vatspec.drafters import init_lm_head_from_target

_build = train.build_drafter


@torch.no_grad()
def _pass_through(fc: torch.nn.Module, layer_ids: list[int], H: int) -> None:
    """fc reads len(layer_ids) blocks of H; keep the deepest layer's block, drop the others."""
    fc.weight.zero_()
    deepest = layer_ids.index(max(layer_ids))
    fc.weight[:, deepest * H : (deepest + 1) * H] = torch.eye(H)


@torch.no_grad()
def _copy_mlp_attn(dst, src) -> None:
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(dst.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
    dst.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight)
    dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)


@torch.no_grad()
def init_from_target(drafter, target) -> None:
    layers, H = target.model.model.layers, target.hidden_size
    ids = list(drafter.target_layer_ids)
    src = max(ids) + 1
    _pass_through(drafter.fc, ids, H)
    if drafter.kind == "eagle3":
        init_lm_head_from_target(drafter, target)
        dst, t = drafter.midlayer, layers[src]
        for name in ("q_proj", "k_proj", "v_proj"):  # input [emb | hidden]: the hidden half only
            w = getattr(dst.self_attn, name).weight
            w.zero_()
            w[:, H:] = getattr(t.self_attn, name).weight
        _copy_mlp_attn(dst, t)
        dst.hidden_norm.weight.copy_(t.input_layernorm.weight)
        dst.input_layernorm.weight.copy_(t.input_layernorm.weight)
        return
    drafter.hidden_norm.weight.copy_(layers[src].input_layernorm.weight)
    for j, dst in enumerate(drafter.layers):
        t = layers[min(src + j, len(layers) - 1)]
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(dst.self_attn, name).weight.copy_(getattr(t.self_attn, name).weight)
        _copy_mlp_attn(dst, t)
        dst.input_layernorm.weight.copy_(t.input_layernorm.weight)
    drafter.norm.weight.copy_(target.model.model.norm.weight)


def build_drafter(cfg, target, counts=None):
    drafter = _build(cfg, target, counts)
    if _tinit.pop(0):
        init_from_target(drafter, target)
    return drafter


if __name__ == "__main__":
    # train_arms builds the arms in command-line order: one flag per arm
    _tinit = [a.partition("=")[0].endswith("_tinit") for a in sys.argv[5:]]
    train.build_drafter = build_drafter
    sys.argv[0] = str(Path(__file__).with_name("pilot_arms.py"))
    runpy.run_path(sys.argv[0], run_name="__main__")
