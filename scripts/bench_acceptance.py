"""Acceptance of trained drafts on the target's own greedy answers to benchmark prompts: the decode τ of
temperature 0 without the decode loop's few prompts.

At T = 0 the decode loop commits exactly the target's greedy text, so whether a draft is accepted at a
position is fixed by that text. Teacher-forced on it, training's simulated verification gives the acceptance
decoding would see, at every position of every prompt instead of the rounds of the few prompts a timed
decode can afford. What this cannot give is wall-clock speed (`vatspec eval` measures that).

    .venv/bin/python scripts/bench_acceptance.py --answers runs/bench-2-26.jsonl --prompts 2:26 \\
        --pair EAGLE3_VAT=EAGLE3 EAGLE3=reports/demo/runs/eagle3 EAGLE3_VAT=reports/demo/runs/eagle3_vat

``--answers``: the target's greedy answers (128 new tokens at most) to prompts ``--prompts LO:HI`` of every
bundled benchmark, written there by ``vatspec.data.regenerate`` when the file does not exist (they are
evaluation prompts: never train on this file). Each ``NAME=RUN`` is a run folder or one of its checkpoint
folders, read with its own saved config (max length, anchors, precision). Prints τ_sim (1 + accepted drafts
per chain) overall and per benchmark, the per-position accuracy, and for each ``--pair A=B`` the difference
A - B with a 95% paired bootstrap interval over prompts (each prompt's chains pooled). Two threads by default
(``--threads``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vatspec import data as D
from vatspec.benchmarks import list_benchmarks, load_benchmark
from vatspec.config import load_config
from vatspec.metrics import MetricAccumulator
from vatspec.stats import paired_difference
from vatspec.target import open_target
from vatspec.train import CHAINS_KEY, arms_micro_step, build_arm, pad_id, step_generator, tokenize_items


def answers(target, path: Path, lo: int, hi: int) -> list:
    """The target's greedy answers to prompts ``lo:hi`` of every benchmark (regenerated once into ``path``)."""
    if not path.exists():
        convs = [c for b in list_benchmarks() for c in load_benchmark(b)[lo:hi]]
        D.regenerate(convs, target, path, batch_size=16, max_new_tokens=128)
    return D.load_conversations(path)


def per_prompt(run: str, target, convs) -> dict:
    """One draft's chains on each prompt: ``{"accepted": [sum per prompt], "chains": [...], "acc": [...]}``."""
    saved = load_config(Path(run) / "config.yaml")  # a run folder and each of its checkpoints hold one
    # the drafter's own CE: no accept head to build, the same chains and verification
    cfg = load_config(None, [f"drafter.kind={saved.drafter.kind}", f"loss.kind={saved.drafter.kind}",
                             f"drafter.num_anchors={saved.drafter.num_anchors}",
                             f"drafter.block_size={saved.drafter.block_size}",
                             f"drafter.ttt_steps={saved.drafter.ttt_steps}",
                             f"drafter.draft_vocab_size={saved.drafter.draft_vocab_size}",
                             f"train.precision={saved.train.precision}", f"train.seed={saved.train.seed}"])
    device = torch.device("cpu")
    arm = build_arm(cfg, target, None, 1, device=device, init_from=run)
    arm.model.eval()
    examples = tokenize_items(convs, target.tokenizer, saved.data.max_length, "--answers")
    out = {"accepted": [], "chains": [], "ids": [e.id for e in examples]}
    acc = MetricAccumulator()
    with torch.no_grad():
        for i, ex in enumerate(examples):
            batch = D.collate([ex], pad_id(target)).to(device)
            res = next(arms_micro_step([arm], target, batch, [step_generator(cfg.train.seed, -1, i, 0, device)]))
            chains = res.metrics.chain_accepted
            out["accepted"].append(float(chains.sum()))
            out["chains"].append(chains.numel())
            acc.add(res.metrics)
    summary = acc.summary()
    summary.pop(CHAINS_KEY, None)
    out["acc"] = summary["acc"]
    return out


def tau(r: dict, keep=lambda i: True) -> float:
    num = sum(a for i, a in zip(r["ids"], r["accepted"]) if keep(i))
    den = sum(c for i, c in zip(r["ids"], r["chains"]) if keep(i))
    return 1.0 + num / max(den, 1)


def bench_of(conv_id: str) -> str:
    """The benchmark a conversation id belongs to: "HumanEval/3" -> "humaneval", "gsm8k/12" -> "gsm8k"."""
    return conv_id.split("/")[0].lower()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--answers", type=Path, required=True)
    ap.add_argument("--prompts", default="2:26", help="LO:HI of each benchmark, when --answers is made")
    ap.add_argument("--pair", action="append", default=[], help="A=B: A - B with a paired interval")
    ap.add_argument("--target", default="default", help="the target the drafts were trained for (default: SmolLM2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("runs", nargs="+", help="NAME=RUN (a run folder or one of its checkpoint folders)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lo, hi = (int(x) for x in args.prompts.split(":"))
    target = open_target(args.target, device="cpu", dtype="float32")
    convs = answers(target, args.answers, lo, hi)
    runs = dict(r.split("=", 1) for r in args.runs)
    res = {name: per_prompt(run, target, convs) for name, run in runs.items()}
    benches = sorted({bench_of(i) for i in next(iter(res.values()))["ids"]})
    print(f"teacher-forced acceptance on the target's greedy answers to {len(convs)} benchmark prompts "
          f"({args.answers})")
    print(f"{'draft':<14} {'tau_sim':>8} " + " ".join(f"{b:>10}" for b in benches) + "  per-position acc")
    for name, r in res.items():
        per = [tau(r, lambda i, b=b: bench_of(i) == b) for b in benches]
        print(f"{name:<14} {tau(r):8.3f} " + " ".join(f"{t:10.3f}" for t in per) + "  "
              + " ".join(f"{a:.3f}" for a in r["acc"]))
    for pair in args.pair:
        a, b = pair.split("=", 1)
        d = paired_difference(res[a]["accepted"], res[b]["accepted"], res[a]["chains"], res[b]["chains"])
        print(d.sentence("tau_sim on benchmark answers", a, b, "prompts"))
    out = {n: {**r, "tau_sim": tau(r)} for n, r in res.items()}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
