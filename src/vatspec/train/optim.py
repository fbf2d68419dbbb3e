"""The drafter's optimizer (``optim.kind``): AdamW, or Muon on the hidden matrices with AdamW on the rest.

Muon (``torch.optim.Muon``) replaces each hidden matrix's momentum by (approximately) its nearest
semi-orthogonal matrix before the step, so every direction of the update moves at about the same rate;
vectors (norms), the lm_head and the accept head keep AdamW (``torch.optim.AdamW``), as Muon is usually
run. Its update is scaled by ``0.2 * sqrt(max(rows, cols))`` (``adjust_lr_fn="match_rms_adamw"``) so that
its RMS matches a typical AdamW update's, which lets one lr serve both kinds of parameter;
``optim.muon_lr_scale`` multiplies it for the Muon group. ``MuonWithAdamW`` steps, schedules and saves the
two as one optimizer.
"""

from __future__ import annotations

import re

import torch
from torch import nn

KINDS = ("adamw", "muon")
# a drafter's hidden matrices: attention and MLP projections of its decoder layers, and fc
HIDDEN_MATRIX = re.compile(r"(^|\.)(self_attn|mlp)\.\w+_proj\.weight$|(^|\.)fc\.weight$")


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over the hidden matrices and ``torch.optim.AdamW`` over the rest, as one optimizer:
    its ``param_groups`` are the two optimizers' own group dicts (Muon's first), so a scheduler's lr reaches
    both; its state dict is the standard one over the parameters in that order (Muon's, then AdamW's)."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW, fp32_orthogonalise: bool = False):
        # not Optimizer.__init__: the groups and state are the two optimizers' own, not copies
        self.muon, self.adamw = muon, adamw
        self.fp32_orthogonalise = fp32_orthogonalise
        self.defaults = {}
        self.param_groups = [*muon.param_groups, *adamw.param_groups]
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = {}, {}
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}

    @property
    def state(self):
        return {**self.muon.state, **self.adamw.state}

    @torch.no_grad()
    def step(self, closure=None):
        if self.fp32_orthogonalise:
            from unittest import mock

            with mock.patch.object(torch.optim._muon, "_zeropower_via_newtonschulz", newton_schulz_fp32):
                self.muon.step()
        else:
            self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        a, b = self.muon.state_dict(), self.adamw.state_dict()
        n = sum(len(g["params"]) for g in a["param_groups"])
        return {"state": {**a["state"], **{i + n: s for i, s in b["state"].items()}},
                "param_groups": [*a["param_groups"],
                                 *({**g, "params": [i + n for i in g["params"]]} for g in b["param_groups"])]}

    def load_state_dict(self, state_dict: dict) -> None:
        """The two optimizers' parts by position (Muon's groups first), keys kept as given (positions, or the
        parameter names a sharded run saves); a group missing one of torch's fields takes its default."""
        k = len(self.muon.param_groups)
        groups, state = state_dict["param_groups"], state_dict["state"]
        parts = []
        for opt, gs in ((self.muon, groups[:k]), (self.adamw, groups[k:])):
            ids = [i for g in gs for i in g["params"]]
            parts.append({"state": {i: state[i] for i in ids if i in state},
                          "param_groups": [{**opt.defaults, **g} for g in gs]})
        self.muon.load_state_dict(parts[0])
        self.adamw.load_state_dict(parts[1])
        self.param_groups[:] = [*self.muon.param_groups, *self.adamw.param_groups]


def newton_schulz_fp32(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                       eps: float) -> torch.Tensor:
    """torch's Muon orthogonalisation (``torch.optim._muon._zeropower_via_newtonschulz``: the same quintic
    Newton-Schulz iteration, coefficients and normalisation) in float32 instead of bfloat16. A CPU without bf16
    hardware (no AVX512-BF16 or AMX) emulates bf16 products, many times slower than float32 there
    (docs/LOG.md, "Figures moved out of code comments")."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def build_optimizer(module: nn.Module, optim_cfg, precision: str = "fp32") -> torch.optim.Optimizer:
    """The optimizer ``optim_cfg`` names over ``module``'s trainable parameters, in ``module.parameters()``
    order within each group (``optim_cfg.lr`` resolved already). ``precision`` is unused: torch's Muon runs
    its orthogonalisation in bfloat16 whatever the training precision, except on a device that does not
    multiply bf16 in hardware, where it runs in float32 (``newton_schulz_fp32``)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    kw = dict(lr=optim_cfg.lr, weight_decay=optim_cfg.weight_decay)
    if optim_cfg.kind == "adamw":
        return torch.optim.AdamW([p for _, p in named], betas=optim_cfg.betas, **kw)
    if optim_cfg.kind != "muon":
        raise ValueError(f"optim.kind={optim_cfg.kind!r} is not one of {KINDS}")
    is_hidden = {n: bool(HIDDEN_MATRIX.search(n)) and p.dim() == 2 for n, p in named}
    hidden = [p for n, p in named if is_hidden[n]]
    rest = [p for n, p in named if not is_hidden[n]]
    if not hidden:
        raise ValueError("optim.kind=muon: the drafter has no hidden matrices (attention / MLP projections, fc)")
    muon = torch.optim.Muon(hidden, lr=optim_cfg.lr * optim_cfg.muon_lr_scale, weight_decay=optim_cfg.weight_decay,
                            adjust_lr_fn="match_rms_adamw")
    from vatspec.target.precision import native_bf16

    return MuonWithAdamW(muon, torch.optim.AdamW(rest, betas=optim_cfg.betas, **kw),
                         fp32_orthogonalise=not native_bf16(hidden[0].device))
