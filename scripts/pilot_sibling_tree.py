"""Would a small draft tree (several candidates for the first drafted token) beat the calibrated chain?

EAGLE-2/3 serving (SGLang's ``speculative-eagle-topk`` > 1) verifies a tree of draft tokens instead of
one chain: a slot whose top-1 guess is wrong may still hold the target's token among its top m. At
T = 0 whether a tree would have been accepted is fixed by the target's greedy text, so it can be
weighed offline from one chain decode, before a tree decoder (tree attention mask, tree cache
commit) is built.

Each draft of a demo report folder decodes held-out prompts at T = 0 with 2 drafted tokens per
round; every round records the draft's top m candidates for its first drafted token (their target
ids), the target's token at that position (the round's first committed token) and how many drafts
verification accepted. The trees weighed (the bonus token always committed):
- chain k: the calibrated chain (k = 1, 2);
- siblings m: the top m candidates for slot 1 (k = 1 otherwise): commits 1 + [target token in top m];
- siblings m + 1: those, and the draft's second token after its top-1 candidate: commits 3 when the
  chain of 2 was wholly accepted, 2 when slot 1's target token is among the top m, else 1.
A tree of n drafted nodes is verified in one target pass over n + 1 tokens; its cost is taken as the
chain pass over as many tokens (`calibrate.measure_round_pieces`, timed here in AR steps: a tree's
attention mask differs, its linear layers, the cost on a CPU, do not), plus the drafter's work for
the chain of the same depth (the top m of slot 1 come from the logits the chain computes anyway; a
real tree decoder also pays building the mask and committing the accepted branch, not counted).

The tree is chosen on the calibration split (held-out training prompts, as the demo's calibration
does) and reported on the bundled benchmarks' prompts 2..(2 + --per-bench), with a paired bootstrap
over prompts of its speedup against k = 1 (the demo's choice).

    VATSPEC_HOME=... .venv/bin/python scripts/pilot_sibling_tree.py reports/demo --out tree.json

Measured with it: docs/results.md, "Decoding lever: a small draft tree". Not a decode option: on a 2-core CPU
no tree beat k = 1.
"""

from __future__ import annotations

import json

import numpy as np
import torch

# scripts/ is on the path of a script run from it: the confidence-gate pilot's arms, options, prompts and speedup
from pilot_confidence_gate import ARMS, pilot_parser, prompt_sets, speedup

from vatspec.calibrate import measure_round_pieces
from vatspec.decode import generate
from vatspec.drafters.dflash import DFlashDrafter, DFlashSession
from vatspec.drafters.eagle3 import Eagle3Session
from vatspec.drafts import open_draft
from vatspec.stats import paired_difference
from vatspec.target import open_target

K = 2  # drafted tokens per recorded round


class Recorder:
    """Records, around the drafters' greedy ``propose``, the target ids of the draft's top ``m`` candidates for
    the round's first drafted token: EAGLE-3's from the logits its last ``extend`` left, DFlash's from
    ``draft_block``'s first slot. ``rounds[i]``: one list per ``propose``."""

    def __init__(self, m: int):
        self.m = m
        self.rounds: list[list[int]] = []

    def install(self) -> None:
        e3_propose, df_block = Eagle3Session.propose, DFlashSession.draft_block
        rec = self

        def e3(session, k, **kw):
            rec.rounds.append(session._tid[session._logits.topk(rec.m).indices].tolist())
            return e3_propose(session, k, **kw)

        def df(session, k=None):
            logits, hidden = df_block(session, k)
            if logits.shape[0]:  # (the cost timing also drafts k = 0)
                rec.rounds.append(logits[0].topk(rec.m).indices.tolist())
            return logits, hidden

        Eagle3Session.propose = e3
        DFlashSession.draft_block = df


def decode_rounds(target, drafter, prompts, tokens: int, rec: Recorder) -> list[dict]:
    """Per drafting round: prompt index, top-m candidates for slot 1, the target's token there, drafted, accepted."""
    rows = []
    for pi, ids in enumerate(prompts):
        rec.rounds.clear()
        res = generate(target, ids, drafter, k=K, max_new_tokens=tokens)
        n = 1  # tokens[n] is the first token a round commits
        recorded = iter(rec.rounds)
        for r in res.rounds:
            if r.drafted > 0:
                rows.append({"p": pi, "top": next(recorded), "y": res.tokens[n], "drafted": r.drafted,
                             "acc": r.accepted})
            n += r.committed
        assert next(recorded, None) is None, "a recorded proposal without its round"
    return rows


def shapes(m_max: int, n_max: int) -> list[tuple[str, int, int]]:
    """(name, m, depth): m <= m_max candidates for slot 1; depth 2 adds the draft's second token under its
    top-1. Only trees whose verify pass (nodes + 1 tokens) was timed: at most n_max tokens."""
    out = [("chain 1", 1, 1), ("chain 2", 1, 2)]
    out += [(f"siblings {m}", m, 1) for m in range(2, m_max + 1) if m + 1 <= n_max]
    out += [(f"siblings {m} + 1", m, 2) for m in range(2, m_max + 1) if m + 2 <= n_max]
    return out


def tree(rows, cost, m: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """Per round (committed tokens, cost in AR steps) under the tree of m candidates for slot 1, depth 1 or 2."""
    com, cst = np.empty(len(rows)), np.empty(len(rows))
    for i, r in enumerate(rows):
        d = min(depth, r["drafted"])
        if r["acc"] >= 1:  # the top-1 candidate was the target's token
            com[i] = 1 + min(r["acc"], d)
        else:
            com[i] = 1 + (r["y"] in r["top"][:m])
        nodes = m + d - 1
        cst[i] = cost["draft"][d] + cost["verify"][nodes + 1]
    return com, cst


def per_prompt_difference(rows, a, b) -> tuple[float, float, float]:
    """Speedup of tree a minus tree b (each a pooled ratio: committed / cost), prompts resampled:
    (estimate, 2.5%, 97.5%)."""
    prompts = np.array([r["p"] for r in rows])
    groups = [np.flatnonzero(prompts == p) for p in np.unique(prompts)]
    com_a, cst_a, com_b, cst_b = ([x[g].sum() for g in groups] for x in (*a, *b))
    d = paired_difference(com_a, com_b, cst_a, cst_b)
    return d.estimate, d.low, d.high


def main() -> None:
    ap = pilot_parser(__doc__)
    ap.add_argument("--m-max", type=int, default=4, help="most candidates for slot 1")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not args.from_json:
        rec = Recorder(args.m_max)
        rec.install()
        target = open_target("default", device="cpu", dtype="float32")
        sets = prompt_sets(args.report, target.tokenizer, args.calibration, args.per_bench)
        res = {}
        for arm in ARMS:
            drafter, _ = open_draft(args.report / "runs" / arm, target)
            res[arm] = {name: decode_rounds(target, drafter, ps, args.tokens, rec) for name, ps in sets.items()}
            # passes over up to m_max + 2 tokens (the largest tree's nodes and the pending token); DFlash drafts
            # at most block_size - 1, which also bounds the passes timed beside its drafts
            k_max = min(args.m_max + 1, drafter.k) if isinstance(drafter, DFlashDrafter) else args.m_max + 1
            pieces = measure_round_pieces(target, drafter, sets["calibration"][0], k_max, reps=args.reps)
            res[arm]["cost"] = {"ar_s": pieces.ar_step_s, "verify": pieces.verify, "draft": pieces.draft}
            args.out.write_text(json.dumps(res))  # each finished arm is kept
    res = json.loads(args.out.read_text())
    for arm, sets in res.items():
        cost = sets["cost"]
        cal = sets["calibration"]
        held = [{**r, "p": f"{b}/{r['p']}"} for b, rows in sets.items() if b not in ("cost", "calibration")
                for r in rows]
        n_max = len(cost["verify"]) - 1
        m_max = len(cal[0]["top"])
        # at T = 0 the chain's first draft is the top-1 candidate: accepted exactly when it is the target's token
        odd = sum((r["acc"] >= 1) != (r["y"] == r["top"][0]) for r in cal + held)
        print(f"== {arm}: AR step {cost['ar_s'] * 1e3:.1f} ms; target pass over 1..{n_max} "
              "tokens " + " ".join(f"{v:.2f}" for v in cost["verify"][1:]) + " AR steps; drafter, k = 0.."
              f"{len(cost['draft']) - 1}: " + " ".join(f"{v:.3f}" for v in cost["draft"])
              + f"; rounds where top-1 and acceptance disagree: {odd}")
        for name, rows in (("calibration", cal), ("benchmarks", held)):
            scored = [(s, tree(rows, cost, m, d)) for s, m, d in shapes(m_max, n_max)]
            print(f"   {name} ({len(rows)} rounds): " + "  ".join(
                f"{s}: tau {com.mean():.3f} {speedup(com, cst):.3f}x" for s, (com, cst) in scored))
        name, m, d = max(shapes(m_max, n_max), key=lambda s: speedup(*tree(cal, cost, s[1], s[2])))
        best, base = tree(held, cost, m, d), tree(held, cost, 1, 1)
        est, lo, hi = per_prompt_difference(held, best, base)
        print(f"   best on calibration: {name}; on the benchmarks tau {best[0].mean():.3f} {speedup(*best):.3f}x "
              f"against k = 1's tau {base[0].mean():.3f} {speedup(*base):.3f}x: {est:+.3f} [{lo:+.3f}, {hi:+.3f}] "
              "(95%, prompts resampled)")
        for mm in range(2, min(m_max, n_max - 1) + 1):  # each sibling count against k = 1
            e, lo, hi = per_prompt_difference(held, tree(held, cost, mm, 1), base)
            print(f"   siblings {mm} - chain 1 on the benchmarks: {e:+.3f} [{lo:+.3f}, {hi:+.3f}]")


if __name__ == "__main__":
    main()
