"""One optimizer step of the demo's four lockstep arms, two ways side by side on the same batches.

``--compare teacher`` (default): each arm its own teacher vs the shared teacher
(``chunked.shared_teacher``). In lockstep every arm reads the same target rows: EAGLE-3 and
EAGLE-3 + VAT the same rows through the same draft vocabulary, the two DFlash arms the same
anchors. Shared, the target side of the chunked loss (the target's lm_head over the full vocabulary
on those rows, argmax and soft labels) runs once per drafter kind instead of once per arm.

``--compare precision``: float32 vs bf16 autocast (``train.precision``), both with the shared
teacher. Under bf16 every matmul of the step, the chunked lm_heads included, multiplies bf16 copies;
on a CPU with AVX512-BF16 that is ~2.2x faster per product than float32.

``--compare optimizer``: AdamW vs Muon on the hidden matrices (``optim.kind``), both bf16 with the
shared teacher: what Muon's orthogonalisation adds to a step.

``--compare loss_on``: the answer tokens supervised vs every position (``data.loss_on``), both bf16
with Muon and the shared teacher: what the extra supervised positions cost.

Both modes train their own copy of the same arms from the demo's feature cache, alternating (the
order flips every step, ``timer.SideBySide``), and the script prints the median (and min) seconds of one
step of the four arms and the ratio.

    .venv/bin/python perf/bench_demo_step.py [--compare MODE] [--threads 2] [--steps 8]

Needs the demo's feature cache (``vatspec demo`` makes it).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import torch
from timer import SideBySide

from vatspec import data as D
from vatspec.data import BatchIterator
from vatspec.drafters import plan_batch
from vatspec.features import CachedTarget, FeatureCache
from vatspec.objective.chunked import TeacherShare
from vatspec.outputs import vatspec_home
from vatspec.target import open_target
from vatspec.target.precision import precision_context
from vatspec.train import (
    MIN_SUPERVISED,
    arm_step,
    build_arm,
    pad_id,
    shared_target_pass,
    step_generator,
)
from vatspec_recipes.experiment import arm_configs
from vatspec_recipes.recipe import load_recipe

MODES = {  # --compare -> {mode: (shared teacher, precision, optimizer, loss_on)}
    "teacher": {"alone": (False, "fp32", "adamw", "assistant"), "shared": (True, "fp32", "adamw", "assistant")},
    "precision": {"fp32": (True, "fp32", "adamw", "assistant"), "bf16": (True, "bf16", "adamw", "assistant")},
    "optimizer": {"adamw": (True, "bf16", "adamw", "assistant"), "muon": (True, "bf16", "muon", "assistant")},
    "loss_on": {"assistant": (True, "bf16", "muon", "assistant"), "all": (True, "bf16", "muon", "all")},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compare", choices=list(MODES), default="teacher")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per mode")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    recipe = load_recipe("demo")
    size = dataclasses.replace(recipe.size, precision="fp32")  # the mode sets the autocast
    home = vatspec_home() / "demo"
    stem = f"regen-n{size.prompts}-t{size.regen_tokens}-s{size.seed}"
    data, cache_dir = home / f"{stem}.jsonl", home / f"{stem}.features-m{size.max_length}"
    if not cache_dir.is_dir():
        raise SystemExit(f"{cache_dir}: no feature cache; run `vatspec demo` first")
    target = open_target("default", device="cpu", dtype="float32")
    cache = FeatureCache(cache_dir)
    examples = [e for e in cache.examples(range(len(cache.rows))) if sum(e.loss_mask) >= MIN_SUPERVISED]
    cached = CachedTarget(target, [cache])
    counts = D.token_counts(examples, target.vocab_size)
    modes = MODES[args.compare]
    runs = Path(tempfile.mkdtemp()) / "runs"
    arms = {m: [build_arm(c, target, counts, 100, device=target.device)
                for c in arm_configs(recipe.arms, dataclasses.replace(size, optim=optim, precision=precision), data,
                                     runs)]
            for m, (_, precision, optim, _) in modes.items()}
    first, second = arms.values()  # the same start in each mode (the arm's seed), on the one target
    assert all(torch.equal(p, q) for a, b in zip(first, second)
               for p, q in zip(a.model.parameters(), b.model.parameters()))
    # the same batches (same seed) with the answers supervised, or every position (data.loss_on)
    batches = {on: BatchIterator([e.supervise_all() for e in examples] if on == "all" else examples,
                                 size.batch_size, pad_id(target), seed=0) for on in ("assistant", "all")}
    t = SideBySide(list(modes), repeats=args.steps, warmup=1)
    for step, order in t.rounds():  # step 0 warms up
        batch_of = {on: next(it) for on, it in batches.items()}
        for mode in order:
            shared_teacher, precision, _, loss_on = modes[mode]
            batch = batch_of[loss_on]
            gens = [step_generator(0, step, 0, 0) for _ in arms[mode]]
            with t.time(mode):
                plans = [plan_batch(a.drafter, batch, a.cfg.drafter, g, with_logits=not a.loss_cfg.chunk_size)
                         for a, g in zip(arms[mode], gens)]
                touts = shared_target_pass(cached, batch, [a.drafter for a in arms[mode]], plans)
                shared = TeacherShare() if shared_teacher else None
                for a, tout, plan, g in zip(arms[mode], touts, plans, gens):
                    a.opt.zero_grad(set_to_none=True)
                    with precision_context(batch.input_ids.device, precision):
                        res = arm_step(a.model, a.drafter, batch, tout, plan, a.loss_cfg, g, shared)
                    res.loss.backward()
                    a.opt.step()
    print(f"{size.batch_size} x {size.max_length} tokens, {len(first)} arms ({', '.join(recipe.arms)}), "
          f"{args.threads} threads, seconds of one step of the arms over {args.steps} steps")
    t.report(base=list(modes)[1])  # the ratio first / second mode: alone / shared, fp32 / bf16, adamw / muon, ...


if __name__ == "__main__":
    main()
