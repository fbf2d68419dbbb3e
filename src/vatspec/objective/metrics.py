"""Training-time diagnostics of drafted chains: what users of the reference trainers ask for
(per-step and conditional top-1 accuracy, simulated tau) plus the paper's VAT diagnostics
(mean first rejection, post-rejection match rate, accept-head accuracy and error on the first rejection r).

Pure, no grad. Metrics are ratios of counts; ``MetricAccumulator`` sums the counts over batches
and divides once at the end, so a held-out split evaluated in many batches gives the same numbers
as one big batch.

Worked example (k = 3, two chains, all valid; "match" = draft argmax == target argmax)::

    chain a: match = 1 1 0      chain b: match = 1 0 1
    acc      = 2/2 1/2 1/2      per-step top-1
    cond_acc = 2/2 1/2 0/1      step j among chains whose steps < j all matched
    tau_sim  = 1 + 1 + 1*0.5 + 1*0.5*0 = 2.5
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vatspec.drafters.base import DraftOutput
from vatspec.objective.verify import Verification, draft_to_target


def _leading_ones(x: Tensor) -> Tensor:
    """[..., k] bool -> [...] long: how many positions from the start are all True."""
    return x.long().cumprod(-1).sum(-1)


def _batch_counts(
    out: DraftOutput,
    v: Verification,
    head_logits: Tensor | None,
    d2t: Tensor | None,
    head_threshold: float,
    draft_argmax: Tensor | None = None,
) -> tuple[dict[str, Tensor], Tensor]:
    """Summable counts for one batch (per-step ones [k], the rest scalars; float64, detached), and
    the greedy accepted length of every chain with a valid position ([chains] long).
    ``draft_argmax`` [..., k] draft ids: the argmax of ``out.logits``, given when those are None."""
    valid = out.valid  # [..., k]
    k = valid.shape[-1]
    j = torch.arange(k, device=valid.device)
    with torch.no_grad():
        if draft_argmax is None:
            draft_argmax = out.logits.argmax(-1)
        draft = draft_to_target(draft_argmax, d2t)  # [..., k] target ids
        match = (draft == v.target_argmax) & valid
        # all earlier steps matched: the chains that reach step j under greedy verification
        reach = torch.cat([torch.ones_like(match[..., :1]), match[..., :-1]], -1).long().cumprod(-1).bool()
        reach = reach & valid
        has = valid.any(-1)  # [...] chains with at least one position
        flat = lambda x: x.reshape(-1, k).sum(0).double()  # noqa: E731  [..., k] -> [k]

        c: dict[str, Tensor] = {
            "valid": flat(valid),
            "correct": flat(match),
            "reach": flat(reach),
            "reach_correct": flat(reach & match),
            "chains": has.sum().double(),
            "num_accepted": v.num_accepted.double()[has].sum(),
        }
        # first rejection as verification saw it; expected mode has none, use the greedy one
        first_reject = v.first_reject if v.first_reject is not None else _leading_ones(match)
        if v.first_reject is not None:
            c["accept_hist"] = torch.bincount(first_reject[has].reshape(-1), minlength=k + 1).double()
        after = valid & (j > first_reject.unsqueeze(-1))  # positions verification threw away
        c["post"] = after.sum().double()
        c["post_match"] = (after & match).sum().double()

        if head_logits is not None:
            if head_logits.shape != valid.shape:
                raise ValueError(f"head_logits {tuple(head_logits.shape)} must be {tuple(valid.shape)}")
            decide = (torch.sigmoid(head_logits.float()) > head_threshold) & valid  # predicted alive
            label = (v.alive > 0.5) & valid
            c["head_n"] = valid.sum().double()
            c["head_correct"] = ((decide == label) & valid).sum().double()
            # Both sides measured where the (predicted / true) alive label first fails; for the true
            # label that is min(first_reject + 1, n_valid), so the +1 cancels and this is the error on
            # first_reject, except that a rejection at the last valid position and no rejection look
            # alike to alive (and to the head).
            err = (_leading_ones(decide) - _leading_ones(label)).abs()
            c["head_abs_err"] = err.double()[has].sum()
    return c, _leading_ones(match)[has].reshape(-1)


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


class ChainMetrics(dict):
    """The metrics of one batch: a plain dict of floats / lists (log it as is) that also carries the
    counts it was computed from (``.counts``), so ``MetricAccumulator.add(metrics)`` aggregates
    batches exactly instead of averaging ratios."""

    def __init__(self, values: dict, counts: dict[str, Tensor], chain_accepted: Tensor | None = None):
        super().__init__(values)
        self.counts = counts
        # [chains] long: greedy accepted length (leading draft matches) of every chain with a valid
        # position; paired across methods scored on the same chains (``stats.paired_difference``)
        self.chain_accepted = chain_accepted


class MetricAccumulator:
    """Sums per-batch counts; ``compute()`` (alias ``summary()``) divides once.

    ``add(out, v, head_logits, d2t=...)`` keeps the counts on the logits' device (no host sync per
    batch); ``add(chain_metrics(...))`` reuses the counts of an already computed batch.
    """

    def __init__(self, head_threshold: float = 0.5):
        self.head_threshold = head_threshold
        self.counts: dict[str, Tensor] = {}
        self.batches = 0

    def add(
        self,
        out: DraftOutput | ChainMetrics,
        v: Verification | None = None,
        head_logits: Tensor | None = None,
        *,
        d2t: Tensor | None = None,
    ) -> None:
        """Add one batch: ``out`` and its Verification ``v`` (``head_logits`` [..., k] if any), or the
        ``ChainMetrics`` that ``chain_metrics`` returned for it (its own head threshold applies)."""
        if isinstance(out, ChainMetrics):
            if v is not None or head_logits is not None:
                raise ValueError("MetricAccumulator.add: pass either ChainMetrics alone or (out, v, ...)")
            c = out.counts
        elif isinstance(out, dict):
            raise TypeError(
                "MetricAccumulator.add got a plain dict: ratios cannot be aggregated exactly; pass the "
                "ChainMetrics that chain_metrics returns, or (DraftOutput, Verification)"
            )
        else:
            if v is None:
                raise ValueError("MetricAccumulator.add(out, v): the Verification v is missing")
            c, _ = _batch_counts(out, v, head_logits, d2t, self.head_threshold)
        if self.counts and self.counts["valid"].shape != c["valid"].shape:
            raise ValueError(f"k changed between batches: {self.counts['valid'].numel()} vs {c['valid'].numel()}")
        if self.counts and set(self.counts) != set(c):
            raise ValueError(
                f"batches disagree on what is measured (head / verification mode): {sorted(set(self.counts) ^ set(c))}"
            )
        for name, x in c.items():
            self.counts[name] = self.counts[name] + x.to(self.counts[name].device) if name in self.counts else x
        self.batches += 1

    def compute(self) -> dict[str, float | list]:
        """The metrics over everything added (NaN where a denominator is 0).

        acc:                   [k] top-1 accuracy per step over valid positions.
        acc_mean:              top-1 accuracy over all valid positions.
        cond_acc:              [k] accuracy at step j given all earlier steps matched.
        tau_sim:               1 + sum_i prod_{j<=i} cond_acc_j (greedy, bonus token included).
        mean_first_reject:     mean first rejection = mean num_accepted (accepted-prefix length, 0..k)
                               under v's rule; the expectation in expected mode.
        tokens_per_step:       mean_first_reject + 1 (docs/evaluation.md's tau, bonus token included).
        accept_hist:           [k + 1] count of chains by num_accepted (greedy / sampled only).
        post_reject_match:     fraction of valid positions after the first rejection where the draft
                               still matches the target (the paper's diagnostic).
        head_acc:              accept-head accuracy at the threshold vs alive (with a head).
        head_first_reject_mae: mean |predicted - true| first rejection from the head (with a head).
        chains, positions:     how many chains / valid positions were measured.
        """
        if not self.counts:
            raise ValueError("MetricAccumulator.compute() before any add()")
        c = {name: x.detach().cpu() for name, x in self.counts.items()}
        valid, correct, reach, reach_correct = (c[n].tolist() for n in ("valid", "correct", "reach", "reach_correct"))
        cond = [_ratio(a, b) for a, b in zip(reach_correct, reach)]
        tau, prod = 1.0, 1.0
        for x in cond:  # a step no chain reaches contributes 0 from there on
            prod *= 0.0 if math.isnan(x) else x
            tau += prod
        m: dict[str, float | list] = {
            "acc": [_ratio(a, b) for a, b in zip(correct, valid)],
            "acc_mean": _ratio(sum(correct), sum(valid)),
            "cond_acc": cond,
            "tau_sim": tau,
            "mean_first_reject": _ratio(c["num_accepted"].item(), c["chains"].item()),
            "post_reject_match": _ratio(c["post_match"].item(), c["post"].item()),
            "chains": int(c["chains"].item()),
            "positions": int(sum(valid)),
        }
        m["tokens_per_step"] = m["mean_first_reject"] + 1.0
        if "accept_hist" in c:
            m["accept_hist"] = [int(x) for x in c["accept_hist"].tolist()]
        if "head_n" in c:
            m["head_acc"] = _ratio(c["head_correct"].item(), c["head_n"].item())
            m["head_first_reject_mae"] = _ratio(c["head_abs_err"].item(), c["chains"].item())
        return m

    summary = compute


def chain_metrics(
    out: DraftOutput,
    v: Verification,
    head_logits: Tensor | None = None,
    *,
    d2t: Tensor | None = None,
    head_threshold: float = 0.5,
    draft_argmax: Tensor | None = None,
) -> ChainMetrics:
    """Metrics of one batch of chains; see ``MetricAccumulator.compute`` for the keys. The result is
    a dict that also carries its counts, so ``MetricAccumulator.add(result)`` aggregates exactly.

    out: DraftOutput ([..., k, Vd] logits, [..., k] valid); v: its Verification; head_logits: [..., k];
    d2t: [Vd] long draft -> target offsets (None = identity); draft_argmax: [..., k] draft ids, needed
    when ``out.logits`` is None (the chunked path computes it chunk by chunk).
    """
    counts, accepted = _batch_counts(out, v, head_logits, d2t, head_threshold, draft_argmax)
    acc = MetricAccumulator(head_threshold)
    acc.counts = counts
    values = acc.compute()
    return ChainMetrics(values, {name: x.detach().cpu() for name, x in counts.items()}, accepted.cpu())
