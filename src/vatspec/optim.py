"""The drafter's optimizer (``optim.kind``): AdamW, or Muon on the hidden matrices with AdamW on the rest.

Muon replaces each hidden matrix's momentum by (approximately) its nearest semi-orthogonal matrix
before the step, so every direction of the update moves at about the same rate; vectors (norms),
the lm_head and the accept head keep AdamW, as Muon is usually run (embeddings and output heads on
AdamW).
Its update is scaled by ``0.2 * sqrt(max(rows, cols))`` so that its RMS matches a typical AdamW
update's (the ``match_rms_adamw`` rule of ``torch.optim.Muon``), which lets one lr serve both kinds
of parameter; ``optim.muon_lr_scale`` multiplies it for the Muon group. What it bought on the
embedded target is in docs/results.md ("Every lever at a glance").
"""

from __future__ import annotations

import math
import re

import torch
from torch import Tensor, nn

KINDS = ("adamw", "muon")
# Muon's quintic Newton-Schulz coefficients and step count (the reference implementation's)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
MUON_MOMENTUM = 0.95
# a drafter's hidden matrices: attention and MLP projections of its decoder layers, and fc
HIDDEN_MATRIX = re.compile(r"(^|\.)(self_attn|mlp)\.\w+_proj\.weight$|(^|\.)fc\.weight$")


def orthogonalize(g: Tensor, steps: int = NS_STEPS, dtype: torch.dtype = torch.float32) -> Tensor:
    """Muon's approximate orthogonalisation of a ``[m, n]`` matrix: ``U V^T`` of its SVD, with singular
    values brought near 1 (within about [0.5, 1.3]) by ``steps`` quintic Newton-Schulz iterations, computed in
    ``dtype`` (bfloat16 halves its cost where the hardware multiplies it natively)."""
    assert g.dim() == 2, f"orthogonalize expects a matrix, got shape {tuple(g.shape)}"
    a, b, c = NS_COEFFICIENTS
    x = (g / (g.norm() + 1e-7)).to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:  # iterate on the smaller Gram matrix
        x = x.T
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return (x.T if tall else x).to(g.dtype)


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the parameter groups with ``muon=True``, AdamW (decoupled weight decay) on the others.

    Muon step of a matrix W with gradient G: ``B <- m B + (1 - m) G``; ``U = orthogonalize((1 - m) G + m B)``
    (Nesterov); ``W <- W (1 - lr wd) - lr * 0.2 * sqrt(max(rows, cols)) * U``. The AdamW groups follow
    ``torch.optim.AdamW`` exactly (tests/test_optim.py compares both against torch's optimizers).
    ``ns_dtype``: the orthogonalisation's arithmetic (``orthogonalize``); the update is applied in the
    parameter's dtype."""

    def __init__(self, groups, lr: float, betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0,
                 eps: float = 1e-8, momentum: float = MUON_MOMENTUM, ns_steps: int = NS_STEPS,
                 ns_dtype: torch.dtype = torch.float32):
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps, momentum=momentum,
                        ns_steps=ns_steps, muon=False)
        super().__init__(groups, defaults)
        self.ns_dtype = ns_dtype
        for g in self.param_groups:
            bad = [tuple(p.shape) for p in g["params"] if g["muon"] and p.dim() != 2]
            if bad:
                raise ValueError(f"MuonAdamW: Muon takes matrices only, got shapes {bad}")

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            lr, wd = g["lr"], g["weight_decay"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if wd:
                    p.mul_(1 - lr * wd)
                if g["muon"]:
                    m = g["momentum"]
                    buf = st.setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.lerp_(p.grad, 1 - m)
                    update = orthogonalize(p.grad.lerp(buf, m), g["ns_steps"], self.ns_dtype).to(p.dtype)
                    p.add_(update, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))
                    continue
                if not st:  # the step count a plain int: no device sync per parameter on a GPU
                    st["step"], st["exp_avg"], st["exp_avg_sq"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                b1, b2 = g["betas"]
                st["step"] += 1
                t = st["step"]
                st["exp_avg"].lerp_(p.grad, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (st["exp_avg_sq"] / (1 - b2**t)).sqrt_().add_(g["eps"])
                p.addcdiv_(st["exp_avg"], denom, value=-lr / (1 - b1**t))


def build_optimizer(module: nn.Module, optim_cfg, precision: str = "fp32") -> torch.optim.Optimizer:
    """The optimizer ``optim_cfg`` names over ``module``'s trainable parameters, in
    ``module.parameters()`` order within each group (``optim_cfg.lr`` resolved already). Muon
    orthogonalises in bfloat16 when the run trains in it (``precision``, ``train.precision``), as
    ``torch.optim.Muon`` always does; else in float32."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    kw = dict(lr=optim_cfg.lr, betas=optim_cfg.betas, weight_decay=optim_cfg.weight_decay)
    if optim_cfg.kind == "adamw":
        return torch.optim.AdamW([p for _, p in named], **kw)
    if optim_cfg.kind != "muon":
        raise ValueError(f"optim.kind={optim_cfg.kind!r} is not one of {KINDS}")
    is_hidden = {n: bool(HIDDEN_MATRIX.search(n)) and p.dim() == 2 for n, p in named}
    hidden = [p for n, p in named if is_hidden[n]]
    rest = [p for n, p in named if not is_hidden[n]]
    if not hidden:
        raise ValueError("optim.kind=muon: the drafter has no hidden matrices (attention / MLP projections, fc)")
    groups = [{"params": hidden, "muon": True, "lr": optim_cfg.lr * optim_cfg.muon_lr_scale}, {"params": rest}]
    return MuonAdamW(groups, **kw, ns_dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
