"""Would a draft length chosen per round by the draft's own confidence beat the calibrated fixed k?

Each draft of a demo report folder decodes held-out prompts at T = 0 with k_max drafted tokens per
round, and every round records the draft's probability of each token it proposed (its softmax
maximum: at T = 0 a drafter proposes its argmax) and how many of them verification accepted. At
T = 0 the first d proposals of a round do not depend on how many are asked for, so one decode at
k_max tells how a round under any rule would have ended. The rule weighed here, for a threshold
theta and a cap kmax: draft while the draft's probability of its next token is >= theta, at most
kmax tokens (a variant always drafts at least one). A round that drafts d tokens commits 1 + min(A, d)
and costs the drafter's work plus one target pass over d + 1 tokens; both costs are timed here
(`calibrate.measure_round_pieces`, in AR steps). An EAGLE-3 round under a threshold pays one
draft step more than it keeps (the step whose probability stopped it); a DFlash round computes the
lm_head on every slot it may keep.

The threshold is chosen on the calibration split (held-out training prompts, as the demo's
calibration does) and reported on the bundled benchmarks' prompts 2..(2 + --per-bench), with a
paired bootstrap over prompts of its speedup against fixed k = 1 (the demo's choice).

    VATSPEC_HOME=... .venv/bin/python scripts/pilot_confidence_gate.py reports/demo-run21 --out gate.json

Measured with it: docs/results.md, "Decoding lever: a draft length chosen per round by the draft's
confidence". Not a decode option: it did not beat k = 1.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from vatspec import bench, benchmarks
from vatspec import data as D
from vatspec.calibrate import measure_round_pieces
from vatspec.config import load_config
from vatspec.decode import generate
from vatspec.drafters.dflash import DFlashSession
from vatspec.drafters.eagle3 import Eagle3Drafter, Eagle3Session
from vatspec.drafts import open_draft
from vatspec.target import open_target
from vatspec.train import heldout_split

ARMS = ("eagle3", "eagle3_vat", "dflash", "dflash_vat")
THETAS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


class Recorder:
    """Records, around the drafters' own greedy ``propose``, the draft's probability of each token it proposed
    (the softmax maximum of the draft logits): EAGLE-3's through a hook on its lm_head (the first proposal's
    logits come from the ``extend`` before the round, the later ones from ``propose``), DFlash's from
    ``draft_block``. ``rounds[i]``: one list per ``propose``."""

    def __init__(self):
        self.rounds: list[list[float]] = []
        self._seen: list[float] = []

    def see(self, logits: torch.Tensor) -> None:
        self._seen += torch.softmax(logits.float(), -1).amax(-1).reshape(-1).tolist()

    def install(self) -> None:
        e3_propose, df_propose, df_block = Eagle3Session.propose, DFlashSession.propose, DFlashSession.draft_block

        def proposing(propose, first_from_extend: bool):
            def run(session, k, **kw):
                self._seen = self._seen[-1:] if first_from_extend else []
                proposal = propose(session, k, **kw)
                self.rounds.append(self._seen[: len(proposal)])
                return proposal
            return run

        def block(session, k=None):
            logits, hidden = df_block(session, k)
            self.see(logits)
            return logits, hidden

        Eagle3Session.propose = proposing(e3_propose, True)
        DFlashSession.propose = proposing(df_propose, False)
        DFlashSession.draft_block = block

    def attach(self, drafter) -> None:
        if isinstance(drafter, Eagle3Drafter):  # its own lm_head (DFlash's logits come from draft_block)
            drafter.lm_head.register_forward_hook(lambda _m, _i, out: self.see(out))


def decode_rounds(target, drafter, prompts, k_max: int, tokens: int, rec: Recorder) -> list[dict]:
    """Per drafting round: prompt index, confidences of the drafted tokens, drafted, accepted."""
    rows = []
    for pi, ids in enumerate(prompts):
        rec.rounds.clear()
        res = generate(target, ids, drafter, k=k_max, max_new_tokens=tokens)
        drafting = [r for r in res.rounds if r.drafted > 0]
        assert len(drafting) == len(rec.rounds), (len(drafting), len(rec.rounds))
        rows += [{"p": pi, "conf": c[: r.drafted], "drafted": r.drafted, "acc": r.accepted}
                 for r, c in zip(drafting, rec.rounds)]
    return rows


def pilot_parser(doc: str) -> argparse.ArgumentParser:
    """The options of a pilot that decodes a demo report's drafts on ``prompt_sets`` and times round costs."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("report", type=Path, help="a demo report folder (its runs/<arm> drafts)")
    ap.add_argument("--out", type=Path, required=True, help="JSON of every round and the costs")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--calibration", type=int, default=16, help="held-out training prompts")
    ap.add_argument("--per-bench", type=int, default=6, help="prompts of each bundled benchmark, from the 3rd")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--from-json", action="store_true", help="only re-analyse --out")
    return ap


def prompt_sets(report: Path, tokenizer, calibration: int, per_bench: int) -> dict[str, list[list[int]]]:
    """Prompt token ids by set: ``calibration``, the first held-out training prompts of the report's split (what
    the demo's calibration decodes), then each bundled benchmark's prompts 2..(2 + per_bench) (the demo
    evaluates 0 and 1)."""
    cfg = load_config(report / "runs" / "eagle3" / "config.yaml")
    _, held = heldout_split(D.load_conversations(cfg.data.train), cfg.data, cfg.train.seed)
    sets = {"calibration": [bench.prompt_ids(tokenizer, c) for c in held[:calibration]]}
    for b in benchmarks.list_benchmarks():
        sets[b] = [bench.prompt_ids(tokenizer, c) for c in benchmarks.load_benchmark(b)[2 : 2 + per_bench]]
    return sets


def rule(rows, cost, kind: str, theta: float | None, kmax: int, min1: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per round (committed tokens, cost in AR steps) under fixed k = kmax (theta None) or the threshold rule."""
    com, cst = np.empty(len(rows)), np.empty(len(rows))
    for i, r in enumerate(rows):
        cap = min(kmax, r["drafted"])
        if theta is None:
            d = cap
            draft = cost["draft"][d]
        else:
            d = 0
            while d < cap and r["conf"][d] >= theta:
                d += 1
            if min1:
                d = max(d, min(1, cap))
            draft = cost["draft"][min(d + 1, cap)] if kind == "eagle3" else cost["draft"][cap]
        com[i] = 1 + min(r["acc"], d)
        cst[i] = draft + cost["verify"][d + 1]
    return com, cst


def speedup(com, cst) -> float:
    return float(com.sum() / cst.sum())


def paired_bootstrap(rows, a, b, resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Speedup of rule a minus rule b, resampling prompts: (estimate, 2.5%, 97.5%)."""
    prompts = np.array([r["p"] for r in rows])
    ids = np.unique(prompts)
    groups = [np.flatnonzero(prompts == p) for p in ids]
    rng = np.random.default_rng(seed)
    diffs = []
    for _ in range(resamples):
        pick = np.concatenate([groups[j] for j in rng.integers(0, len(ids), len(ids))])
        diffs.append(speedup(a[0][pick], a[1][pick]) - speedup(b[0][pick], b[1][pick]))
    return speedup(*a) - speedup(*b), float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))


def main() -> None:
    ap = pilot_parser(__doc__)
    ap.add_argument("--k-max", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not args.from_json:
        rec = Recorder()
        rec.install()
        target = open_target("default", device="cpu", dtype="float32")
        sets = prompt_sets(args.report, target.tokenizer, args.calibration, args.per_bench)
        res = {}
        for arm in ARMS:
            drafter, _ = open_draft(args.report / "runs" / arm, target)
            rec.attach(drafter)
            res[arm] = {name: decode_rounds(target, drafter, ps, args.k_max, args.tokens, rec)
                        for name, ps in sets.items()}
            pieces = measure_round_pieces(target, drafter, sets["calibration"][0], args.k_max, reps=args.reps)
            res[arm]["cost"] = {"ar_s": pieces.ar_step_s, "verify": pieces.verify, "draft": pieces.draft}
        args.out.write_text(json.dumps(res))
    res = json.loads(args.out.read_text())
    for arm, sets in res.items():
        cost, kind = sets["cost"], arm.split("_")[0]
        cal = sets["calibration"]
        held = [{**r, "p": f"{b}/{r['p']}"} for b, rows in sets.items() if b not in ("cost", "calibration")
                for r in rows]
        k_max = len(cost["draft"]) - 1
        print(f"== {arm}: AR step {cost['ar_s'] * 1e3:.1f} ms; target pass over 1..{k_max + 1} tokens "
              + " ".join(f"{v:.2f}" for v in cost["verify"][1:]) + f" AR steps; drafter, k = 0..{k_max}: "
              + " ".join(f"{v:.3f}" for v in cost["draft"]))
        for name, rows in (("calibration", cal), ("benchmarks", held)):
            print(f"   {name} ({len(rows)} rounds): " + "  ".join(
                f"k = {k}: tau {rule(rows, cost, kind, None, k, False)[0].mean():.3f} "
                f"{speedup(*rule(rows, cost, kind, None, k, False)):.3f}x" for k in range(1, k_max + 1)))
        best = max(((t, km, m1) for t in THETAS for km in range(1, k_max + 1) for m1 in (False, True)),
                   key=lambda p: speedup(*rule(cal, cost, kind, *p)))
        for km in range(1, k_max + 1):
            for m1 in (False, True):
                pairs = [(speedup(*rule(cal, cost, kind, t, km, m1)), speedup(*rule(held, cost, kind, t, km, m1)))
                         for t in THETAS]
                print(f"   threshold, kmax {km}{', at least 1' if m1 else ''} (calibration / benchmarks): "
                      + " ".join(f"{t}: {c:.3f}/{b:.3f}" for t, (c, b) in zip(THETAS, pairs)))
        t, km, m1 = best
        gate, base = rule(held, cost, kind, t, km, m1), rule(held, cost, kind, None, 1, False)
        est, lo, hi = paired_bootstrap(held, gate, base)
        print(f"   best on calibration: theta {t}, kmax {km}{', at least 1' if m1 else ''}; on the benchmarks "
              f"tau {gate[0].mean():.3f} {speedup(*gate):.3f}x against k = 1's tau {base[0].mean():.3f} "
              f"{speedup(*base):.3f}x: {est:+.3f} [{lo:+.3f}, {hi:+.3f}] (95%, prompts resampled)")


if __name__ == "__main__":
    main()
